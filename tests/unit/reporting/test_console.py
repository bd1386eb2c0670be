"""Third-party noise is hidden by its message only: the same libraries' other warnings and log
lines still reach the console."""

from __future__ import annotations

import logging
import warnings

from nemo_rl_mtp.reporting.console import quiet_third_party_output


def test_listed_warnings_are_hidden_and_others_of_the_same_category_shown(monkeypatch):
    monkeypatch.delenv("NEMO_RL_MTP_VERBOSE", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party_output()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
        warnings.warn("megatron: this argument is ignored", UserWarning)
    assert [str(warning.message) for warning in caught] == ["megatron: this argument is ignored"]


def test_listed_log_lines_are_hidden_and_the_loggers_other_lines_shown(monkeypatch, caplog):
    monkeypatch.delenv("NEMO_RL_MTP_VERBOSE", raising=False)
    quiet_third_party_output()
    gpt_model = logging.getLogger("megatron.core.models.gpt.gpt_model")
    with caplog.at_level(logging.WARNING):
        gpt_model.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
        gpt_model.warning("something else went wrong")
        logging.getLogger("transformers.configuration_utils").warning("`torch_dtype` is deprecated! Use `dtype` instead!")
    assert [record.getMessage() for record in caplog.records] == ["something else went wrong"]
