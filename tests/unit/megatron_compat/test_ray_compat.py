"""Ray's private names behind probes, against the installed Ray: each works as used, and a
simulated rename falls back with a logged warning instead of failing or passing silently."""

from __future__ import annotations

import logging
import os

import pytest
from ray._private import ray_constants, ray_logging

from nemo_rl_mtp.megatron_compat import ray_compat


def test_forwarded_log_lines_are_collected_by_node_while_listening():
    with ray_compat.forwarded_log_lines() as lines:
        ray_logging.global_worker_stdstream_dispatcher.emit({"ip": "10.0.0.2", "lines": ["error: uv: not found"], "pid": "raylet"})
    ray_logging.global_worker_stdstream_dispatcher.emit({"ip": "10.0.0.2", "lines": ["after"], "pid": "raylet"})
    assert lines == {"10.0.0.2": ["error: uv: not found"]}  # and nothing once the block ended


def test_without_the_dispatcher_node_failures_are_reported_without_cause(monkeypatch, caplog):
    monkeypatch.delattr(ray_logging, "global_worker_stdstream_dispatcher")
    with caplog.at_level(logging.WARNING), ray_compat.forwarded_log_lines() as lines:
        pass
    assert lines == {} and "forwards no log lines this driver can read" in caplog.text


def test_the_uv_hook_switch_is_off_within_the_block_only_and_its_absence_is_logged(monkeypatch, caplog):
    """Off for the block, then as it was: a driver that starts Ray again (tests run many in one
    process) with Ray's uv integration must find it on."""
    monkeypatch.setattr(ray_constants, ray_compat.UV_HOOK_SWITCH, True)
    with ray_compat.uv_hook_disabled() as switched:
        assert switched and not getattr(ray_constants, ray_compat.UV_HOOK_SWITCH)
    assert getattr(ray_constants, ray_compat.UV_HOOK_SWITCH)
    with pytest.raises(RuntimeError), ray_compat.uv_hook_disabled():
        raise RuntimeError("ray.init failed")
    assert getattr(ray_constants, ray_compat.UV_HOOK_SWITCH)
    monkeypatch.delattr(ray_constants, ray_compat.UV_HOOK_SWITCH)
    with caplog.at_level(logging.WARNING), ray_compat.uv_hook_disabled() as switched:
        assert not switched
    assert "has no RAY_ENABLE_UV_RUN_RUNTIME_ENV switch" in caplog.text


def test_liveness_of_local_processes_without_a_ray_started_here():
    assert ray_compat.local_processes_dead() is False


def test_local_start_settings_are_known_to_the_installed_ray_and_an_unknown_one_is_logged(monkeypatch, caplog):
    settings = ray_compat.local_start_settings(179.5)
    assert settings["RAY_raylet_start_wait_time_s"] == settings["RAY_worker_register_timeout_seconds"] == "180"
    assert settings["RAY_USAGE_STATS_ENABLED"] == "0" and len(settings) == 5
    assert not ray_compat._ray_core_knows("no_such_setting_in_ray")
    monkeypatch.setattr(ray_compat, "_ray_core_knows", lambda name: name != "prestart_worker_first_driver")
    with caplog.at_level(logging.WARNING):
        settings = ray_compat.local_start_settings(60)
    assert "RAY_prestart_worker_first_driver" not in settings
    assert "has no RAY_prestart_worker_first_driver setting" in caplog.text


def test_the_users_own_ray_variable_wins_and_ours_are_cleared_afterwards(monkeypatch):
    monkeypatch.setenv("RAY_raylet_start_wait_time_s", "999")
    monkeypatch.delenv("RAY_USAGE_STATS_ENABLED", raising=False)
    with ray_compat.environment_set({"RAY_raylet_start_wait_time_s": "180", "RAY_USAGE_STATS_ENABLED": "0"}) as users:
        assert users == {"RAY_raylet_start_wait_time_s": "999"}
        assert os.environ["RAY_raylet_start_wait_time_s"] == "999" and os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert os.environ["RAY_raylet_start_wait_time_s"] == "999" and "RAY_USAGE_STATS_ENABLED" not in os.environ


def test_the_drivers_failure_signal_handler_is_off_within_the_block_only(monkeypatch, caplog):
    monkeypatch.setattr(ray_constants, ray_compat.FAILURE_HANDLER_SWITCH, False)
    with pytest.raises(RuntimeError), ray_compat.driver_failure_signal_handler_off() as switched:
        assert switched and getattr(ray_constants, ray_compat.FAILURE_HANDLER_SWITCH)
        raise RuntimeError("ray.init failed")
    assert getattr(ray_constants, ray_compat.FAILURE_HANDLER_SWITCH) is False
    monkeypatch.delattr(ray_constants, ray_compat.FAILURE_HANDLER_SWITCH)
    with caplog.at_level(logging.WARNING), ray_compat.driver_failure_signal_handler_off() as switched:
        assert not switched
    assert "has no RAY_DISABLE_FAILURE_SIGNAL_HANDLER switch" in caplog.text
