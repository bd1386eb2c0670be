"""Rollout throughput of megatron-core's inference engine with speculation by the policy's own MTP
heads (k = 1 .. mtp_num_layers drafts per step, and ``auto``) against k = 0, measured side by side
in one process: a sweep over response budgets and batch sizes, first with untrained heads (a
random policy), then after a short imitation of a deterministic task (count on from the prompt's
digit), which trains policy and heads alike. In the sweep the end-of-sequence token is masked, so
every response fills its budget: each variant generates the same number of tokens (sampled
responses differ with k, and a random end would make the workloads differ). Sampling at
temperature 1, as in RL; rejection sampling; drafts from the MTP depths' KV caches (the defaults).
Before the sweep, k = 0 with the random policy and its end-of-sequence token: the same responses
under every budget.

    uv run python -m benchmarks.rollout_throughput [--new-tokens 128 512 2048] [--batches 8 32 128]
        [--repeats 3] [--turn-ms 20] [--figure PATH] [--beside-load] [key=value overrides]

Prints markdown: tokens/s against k = 0 per cell; where a decode step's time goes (trunk forward,
drafts, verification, bookkeeping; attention over the KV caches shown apart); k = 0's tokens/s
with the same responses under growing budgets; the drafts' cost per step against the response
length; the MTP caches' memory. Every variant runs ``--repeats`` times and reports its median.
In a repeat the variants are stepped in turns of ``--turn-ms`` (the one least far along next, so
they finish together), each timed over its own steps (auto's choice of k and its engine's switches
included), so a drift of the machine's speed falls on all of them alike (until 2026-12-05 each
ran its whole rollout in turn, and two identical engines' ratio moved by 5-14% from repeat to
repeat, against 0.4% stepped in turn: ``same_k_engines``). All variants first run mtp_layers + 1
rollouts untimed, in turn as the timed ones (auto's profile of step costs and its first look at
every k, done once per batch size in a training run: until 2026-12-07 auto ran them alone, in
another setting than its timed rollouts, and the fixed variants ran one). ``--clock cpu`` times with the
process's CPU time instead of the wall clock (the breakdown too; both clocks' ratios are
printed): on a machine shared with other jobs their load lands on whichever variant runs while
they do, and the CPU time leaves it out. ``--beside-load`` runs a second CPU-bound process beside
the whole benchmark (a one-thread matmul loop), as another job on a shared machine would; the
output says so. The line after the first table gives auto's worst cell against k = 0 and against
the best fixed k, from the medians and paired: the median over repeats of auto's tokens/s over
the other variant's in the same repeat (the variants' order rotates from repeat to repeat), with
its lowest and highest (an interval of the median: 94% at 5 repeats). Beside the variants runs an
A/A control, a second k = 0 engine doing the same work as the first: how far its paired ratio
strays from 1 is what measurement error alone does to a ratio in this run, the yardstick for
auto's. Last, auto's choices alone: the k of its timed runs valued at the fixed engines' medians,
what its decisions are worth apart from its own timing. ``--figure PATH`` draws the cells (the
figure docs/results.md shows is ``benchmarks/rollout_throughput.png``); without it none is drawn,
so a run with other settings cannot overwrite the tracked one.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.worker_environment import as_the_workers_run
from nemo_rl_mtp.training.imitation import imitation_step
from nemo_rl_mtp.tasks.demonstrations import demonstration_batch
from nemo_rl_mtp.tasks.tokenizer import DigitTokenizer
from nemo_rl_mtp.rollout import incremental_drafts
from nemo_rl_mtp.rollout.engine import RolloutEngine, kv_memory
from nemo_rl_mtp.metrics import DECODE_STEPS, ENGINE_TOKENS_PER_S, EXPECTED_TOKENS_PER_S, SPECULATIVE_TOKENS
from nemo_rl_mtp.rollout.speculation import speculation_metrics
from nemo_rl_mtp.megatron_compat.cpu import paged_attention
from nemo_rl_mtp.training.model import initialize_model_parallel, setup_megatron_policy
from nemo_rl_mtp.cluster.worker import freeze_startup_heap, keep_freed_host_memory
from nemo_rl_mtp.grpo.checked_config import load_checked_config
from tests.support.helpers import free_port

TOKENIZER = DigitTokenizer()
# A second k = 0 engine run beside the first: the same work measured twice, an A/A control whose
# ratios show how far measurement error alone moves a ratio in this run.
CONTROL = "k=0 again"
PROMPT_TOKENS = 3  # <bos> d =
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK_NAME = ["wall"]  # the clock the tables use: main() sets it from --clock
# A variant's turn in ``run_in_turn`` lasts this long on the tables' clock (at least one step).
# Each change of turn slows the next step (another engine's step has evicted its data from the
# caches): turns of one step charge that once per step, which falls hardest on the variant with
# the cheapest steps (k = 0's ran 6% slower than in 10 ms turns, and k = 2 / k = 0 read 1.107
# against 1.080-1.087 in turns of 10, 30 or 100 ms: 2 layers, 32 x 128, trained heads, 12
# repeats, 2026-12-07); turns of equal time charge every variant the same share of its time.
# Longer turns let the machine's drift between turns into the ratios (the standard deviation of
# k = 2 / k = 0 over repeats 0.015 at 10 ms, 0.028 at 30, 0.05 at 100, 0.11 for whole rollouts).
TURN_SECONDS = [0.02]  # main() sets it from --turn-ms


def clock() -> float:
    return CLOCKS[CLOCK_NAME[0]]()
# Where a decode step's time goes: controller/engine methods timed per step, by phase.
PHASES = {
    "trunk": ("controller", ("_dynamic_step_forward_logits",)),
    "drafts": ("controller", ("_compute_serial_mtp_and_sample",)),
    "verification": (
        "controller",
        ("_dynamic_step_sample_logits_and_verify_tokens", "_rewind_kv_cache", "_dynamic_step_sample_logits",
         "_dynamic_step_calculate_log_probs", "_dynamic_step_calculate_log_probs_speculative"),
    ),
    "bookkeeping": ("controller", ("_dynamic_step_context_init", "_dynamic_step_context_bookkeeping")),
    "engine bookkeeping": ("engine", ("async_bookkeep",)),
}


def counting_task(num_prompts: int, length: int, generator: torch.Generator) -> tuple[list, list]:
    """Prompts ``<bos> d =`` and answers counting on from d for ``length`` digits, with no end."""
    starts = torch.randint(0, 10, (num_prompts,), generator=generator).tolist()
    prompts = [TOKENIZER.encode_prompt([start]) for start in starts]
    answers = [[TOKENIZER.first_digit_id + (start + step) % 10 for step in range(1, length + 1)] for start in starts]
    return prompts, answers


def config(args, k, new_tokens: int, batch: int, prompt_tokens: int = PROMPT_TOKENS):
    """The policy config of one cell: room in the engine for the whole batch at full length (the
    keys and values of the decoder's and the MTP layers, in the model's dtype), so no request
    waits for blocks."""
    model = load_checked_config(overrides=list(args.overrides)).policy.megatron_cfg
    kv_width = model.hidden_size * model.num_query_groups // model.num_attention_heads
    element_bytes = torch.tensor([], dtype=getattr(torch, model.params_dtype)).element_size()
    bytes_per_token = 2 * (model.num_layers + args.mtp_layers) * kv_width * element_bytes
    buffer_gb = 1.5 * batch * (new_tokens + prompt_tokens + 4) * bytes_per_token / 1024**3
    return load_checked_config(
        overrides=[
            f"policy.megatron_cfg.mtp_num_layers={args.mtp_layers}",
            f"policy.generation.num_speculative_tokens={k}",
            f"policy.generation.max_new_tokens={new_tokens}",
            f"policy.max_total_sequence_length={new_tokens + prompt_tokens + 3}",
            f"policy.generation.engine.buffer_size_gb={max(buffer_gb, 0.01):.4f}",
            f"policy.generation.engine.max_requests={batch}",
            f"policy.train_global_batch_size={args.train_batch}",
            f"policy.train_micro_batch_size={args.train_batch}",
            f"grpo.num_prompts_per_step={args.train_batch}",
            "grpo.num_generations_per_prompt=2",
            "policy.megatron_cfg.optimizer.lr=3e-3",
            *args.overrides,
        ]
    ).policy


class StepPhases:
    """Wall time per phase of the engine's steps (``PHASES``), and of its attention calls over
    the trunk's and the MTP caches' blocks, by wrapping them on one engine."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.steps = 0

    def timed(self, function, phase: str):
        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[phase] += clock() - start

        async def async_wrapper(*args, **kwargs):
            start = clock()
            try:
                return await function(*args, **kwargs)
            finally:
                self.seconds[phase] += clock() - start

        import inspect

        return async_wrapper if inspect.iscoroutinefunction(function) else wrapper

    def instrument(self, engine) -> None:
        owners = {"controller": engine.controller, "engine": engine}
        for phase, (owner, names) in PHASES.items():
            for name in names:
                setattr(owners[owner], name, self.timed(getattr(owners[owner], name), phase))
        step = engine.step_modern

        def counted_step():
            self.steps += 1
            return step()

        engine.step_modern = self.timed(counted_step, "step")


def attention_timers(phases_of: dict):
    """Time the CPU paged attention of the trunk (``paged_attention.paged_attention``) and of the
    MTP caches (the same function as the drafts bind it), for whichever ``phases_of['current']``."""
    trunk, drafts = paged_attention.paged_attention, incremental_drafts.paged_attention_over_pairs

    def timing(function, phase):
        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                if phases_of.get("current") is not None:
                    phases_of["current"].seconds[phase] += clock() - start

        return wrapper

    paged_attention.paged_attention = timing(trunk, "trunk attention")
    incremental_drafts.paged_attention_over_pairs = timing(drafts, "draft attention")


@contextlib.contextmanager
def end_of_sequence_masked(policy):
    """The output layer never proposes the end-of-sequence token (policy and MTP heads alike)."""
    def masked(module, inputs, output):
        logits, bias = output
        return logits.index_fill(-1, torch.tensor([TOKENIZER.eos_id], device=logits.device), float("-inf")), bias

    handle = policy.model.module.output_layer.register_forward_hook(masked)
    try:
        yield
    finally:
        handle.remove()


class Variant:
    """One engine configuration of a cell, run repeatedly, with its step phases."""

    def __init__(self, name: str, rollout_engine: RolloutEngine):
        self.name, self.rollout_engine = name, rollout_engine
        self.times = {name: [] for name in CLOCKS}
        self.phases, self.output, self.instrumented = StepPhases(), None, None
        self.steps_at_k: dict[int, int] = {}  # the steps of this variant's latest rollout at each k it ran
        self.chosen = []  # auto: the k of each timed run
        self.history = []  # auto: every run's k, expected and realised tokens/s, machine speed read
        self.rollout, self.elapsed, self.timed, self.phases_before = None, None, True, None

    @property
    def progress(self) -> float:
        """How far the current rollout is: its steps over those of this variant's latest rollout
        at the same k (else its latest rollout's; its steps alone before there was one). At the
        same k, not the latest: auto's rollout after a switch from k = 1 to k = 0 (1,081 steps
        against 2,048 at 32 x 2048) was paced by the k = 1 rollout's steps, read itself done at
        half its steps, and ran its last half alone after the others had finished, uninterleaved:
        1.043 of the fixed k = 0 engine in that round, 0.978-0.982 in the two k = 0 rounds after
        it (2 layers, untrained heads, 2026-12-07)."""
        k = self.rollout_engine.num_speculative_tokens
        if k in self.steps_at_k:
            previous = self.steps_at_k[k]
        elif self.output is not None:
            previous = int(self.output[DECODE_STEPS])
        else:
            previous = 1
        return self.rollout.steps / max(previous, 1)

    def begin(self, prompts, seed: int, timed: bool) -> None:
        """A rollout to step: auto chooses its k here (and may rebuild its engine); timed."""
        self.timed, self.elapsed = timed, dict.fromkeys(CLOCKS, 0.0)
        self.phases_before = (self.phases.steps, collections.Counter(self.phases.seconds))
        self.rollout = self._timed(self.rollout_engine.begin, prompts, TOKENIZER.eos_id, TOKENIZER.pad_id, seed)
        if self.instrumented is not self.rollout_engine.engine:  # auto rebuilds its engine
            self.phases.instrument(self.rollout_engine.engine)
            self.instrumented = self.rollout_engine.engine

    def step(self, phases_of: dict) -> bool:
        """One engine step of the rollout, timed; whether it has more."""
        phases_of["current"] = self.phases if self.timed else None
        try:
            return self._timed(self.rollout.step)
        finally:
            phases_of["current"] = None

    def finish(self) -> None:
        self.output = self._timed(self.rollout.finish)
        self.steps_at_k[self.rollout_engine.num_speculative_tokens] = int(self.output[DECODE_STEPS])
        if self.rollout_engine.adaptive is not None:
            record = (SPECULATIVE_TOKENS, EXPECTED_TOKENS_PER_S, ENGINE_TOKENS_PER_S)
            self.history.append((*(float(self.output[key]) for key in record), self.rollout_engine.adaptive.speed))
        if self.timed:
            for name, seconds in self.elapsed.items():
                self.times[name].append(seconds)
            if "speculative_tokens" in self.output:
                self.chosen.append(int(self.output["speculative_tokens"]))
        else:  # untimed runs leave no trace in the phases
            self.phases.steps, self.phases.seconds = self.phases_before

    def _timed(self, function, *args):
        start = {name: read() for name, read in CLOCKS.items()}
        try:
            return function(*args)
        finally:
            for name, read in CLOCKS.items():
                self.elapsed[name] += read() - start[name]

    @property
    def tokens(self) -> int:
        return int((self.output["lengths"] - self.output["prompt_lengths"]).sum())

    @property
    def rate(self) -> float:
        return self.rate_by(CLOCK_NAME[0])

    def rate_by(self, clock_name: str) -> float:
        return self.tokens / statistics.median(self.times[clock_name])

    def paired(self, other: "Variant") -> float:
        """The median over repeats of this variant's tokens/s over ``other``'s in the same repeat:
        runs of one repeat follow each other, so a load that drifts over minutes cancels."""
        return statistics.median(self.paired_ratios(other))

    def paired_ratios(self, other: "Variant") -> list[float]:
        """Per repeat, this variant's tokens/s over ``other``'s. Their lowest and highest bound
        the median with probability 1 - 2 / 2^repeats (94% at 5 repeats): its interval."""
        clock_name = CLOCK_NAME[0]
        return [(self.tokens / mine) / (other.tokens / theirs) for mine, theirs in zip(self.times[clock_name], other.times[clock_name])]

    def acceptance(self) -> list[float]:
        proposed, accepted = self.output["draft_proposed"], self.output["draft_accepted"]
        return [100.0 * float(a) / max(float(p), 1.0) for p, a in zip(proposed, accepted)]

    def per_step_ms(self) -> dict[str, float]:
        steps = max(self.phases.steps, 1)
        return {phase: 1000.0 * seconds / steps for phase, seconds in self.phases.seconds.items()}


def run_cell(policy, args, heads: str, new_tokens: int, batch: int, phases_of: dict) -> dict:
    variants = [Variant(f"k={k}", RolloutEngine(policy, config(args, k, new_tokens, batch))) for k in range(args.mtp_layers + 1)]
    auto = Variant("auto", RolloutEngine(policy, config(args, "auto", new_tokens, batch)))
    variants.append(auto)
    variants.append(Variant(CONTROL, RolloutEngine(policy, config(args, 0, new_tokens, batch))))
    prompts, _ = counting_task(batch, 1, torch.Generator().manual_seed(batch))
    for warm_up in range(args.mtp_layers + 1):  # auto's first looks, in the setting of its timed rollouts
        run_in_turn(variants, prompts, 1000 + warm_up, phases_of, timed=False)
    for repeat in range(args.repeats):
        shift = repeat % len(variants)  # each variant's place in the order rotates
        run_in_turn(variants[shift:] + variants[:shift], prompts, repeat, phases_of)
    print_auto_state(auto)
    memory = kv_memory(variants[args.mtp_layers].rollout_engine.engine)
    result = {"heads": heads, "new_tokens": new_tokens, "batch": batch, "variants": variants, "memory": memory}
    print(f"  {heads} heads, {new_tokens} new tokens, {batch} prompts: "
          + ", ".join(f"{v.name} {v.rate:.0f} tok/s" for v in variants)
          + f", auto ran k={'/'.join(map(str, auto.chosen))}"
          + f"; auto over the fixed engine at the k it ran, per repeat: {' '.join(f'{r:.2f}' for r in same_k_ratios(auto, variants))}"
          + "; auto's rollouts, untimed first (k: expected -> realised tokens/s, machine speed read): "
          + ", ".join(f"{k:.0f}: {expected:.0f} -> {realised:.0f}, {speed:.2f}" for k, expected, realised, speed in auto.history),
          flush=True)  # fmt: skip
    return result


def print_auto_state(auto: Variant) -> None:
    """What auto holds after a cell: its profile's step costs and prior, and each k's latest
    measured rollouts (their number in the context and tokens/s at the first rollout's machine
    speed), so that a choice the table shows can be traced to the looks behind it."""
    tuner = auto.rollout_engine.adaptive
    for (bucket, greedy), state in tuner.contexts.items():
        prior = tuner.prior(bucket, greedy, bucket)
        costs = ", ".join(f"k={k} {1000 * seconds:.2f} ms" for k, seconds in tuner.profiled[bucket].items())
        print(f"    auto, {bucket} requests: profile {costs}; prior vs k=0 " + ", ".join(f"k={k} {prior[k] / prior[0]:.2f}" for k in sorted(prior))
              + "; latest rollouts " + "; ".join(f"k={k}: " + ", ".join(f"#{o.number} {o.tokens_per_s:.0f}" for o in observations)
                                                for k, observations in sorted(state.observations.items())), flush=True)  # fmt: skip


def run_in_turn(variants: list[Variant], prompts, seed: int, phases_of: dict, timed: bool = True, responses_end: bool = False) -> None:
    """Every variant's rollout of ``prompts`` with ``seed``, stepped in turn until all have
    finished, the one least far along (:attr:`Variant.progress`) next, so that they finish
    together; each variant is timed over its own steps alone (its choice of k and start
    included). The machine's speed drifts over seconds (on a 2-core VM two identical engines' whole
    rollouts run one after the other differed by 5-14%, the standard deviation of their ratio over
    8 rounds, and by 0.4% stepped in turn): in turn, every variant runs through the same drift.
    Variants equally far along (engines at the same k take the same steps) go in a random order,
    drawn afresh at every step: a step runs slower after another engine's step that evicted its
    data from the caches, and with ties broken by the order given, a k = 0 engine placed after the
    k = 2 engine always stepped after it (rotating the order keeps who follows whom): at 2 layers
    and 128 tokens auto running k = 0 there ran 0.969 of the fixed k = 0 engine paired, and 0.997
    with the two places swapped, where the A/A control then fell from 0.991 to 0.975. A turn
    lasts ``TURN_SECONDS`` (until 2026-12-07 one step, which slowed k = 0 most: the constant's
    comment)."""
    policy = variants[0].rollout_engine.policy
    with contextlib.nullcontext() if responses_end else end_of_sequence_masked(policy), variants[0].rollout_engine.sampling_session():
        for variant in variants:
            variant.begin(prompts, seed, timed)
        stepping, tie_break = list(variants), random.Random(seed)
        while stepping:
            variant = min(stepping, key=lambda candidate: (candidate.progress, tie_break.random()))
            turn_start = variant.elapsed[CLOCK_NAME[0]]
            while True:
                if not variant.step(phases_of):
                    stepping.remove(variant)
                    break
                if variant.elapsed[CLOCK_NAME[0]] - turn_start >= TURN_SECONDS[0]:
                    break
        for variant in variants:
            variant.finish()


def same_k_ratios(auto: Variant, variants: list[Variant]) -> list[float]:
    """Per timed repeat, auto's tokens/s over the fixed engine's at the k auto ran, in the same
    repeat: what auto costs beyond its choice (its bookkeeping, a switch's engine build), up to
    the noise between two engines (the A/A control)."""
    by_name = {variant.name: variant for variant in variants}
    clock_name = CLOCK_NAME[0]
    return [
        (auto.tokens / mine) / (by_name[f"k={k}"].tokens / by_name[f"k={k}"].times[clock_name][repeat])
        for repeat, (k, mine) in enumerate(zip(auto.chosen, auto.times[clock_name]))
    ]


def throughput_table(cells: list[dict], args) -> str:
    names = [f"k={k}" for k in range(1, args.mtp_layers + 1)]
    other = "cpu" if CLOCK_NAME[0] == "wall" else "wall"
    header = ["heads", "new tokens", "prompts", "response tokens (mean)", "k=0 tokens/s", *[f"{name} vs k=0" for name in names],
              "auto vs k=0 (k of its runs)", "auto vs best fixed k", "paired per repeat: auto vs k=0, vs best fixed k",
              "auto's choices at the fixed k's medians: vs k=0, vs best fixed k",
              f"paired, {CONTROL} vs k=0 (lowest-highest)",
              f"{other} clock: {', '.join(names)}, auto vs k=0",
              "acceptance, draft 1 / 2 (k=2)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in cells:
        variants = {variant.name: variant for variant in cell["variants"]}
        base = variants["k=0"].rate
        auto = variants["auto"]
        best_fixed = max(variants[name].rate for name in ["k=0", *names])
        best_variant = max((variants[name] for name in ["k=0", *names]), key=lambda variant: variant.rate)
        deepest = variants[names[-1]]
        chosen = choices_valued(auto, variants)
        mean_length = deepest.tokens / cell["batch"]
        lines.append(
            f"| {cell['heads']} | {cell['new_tokens']} | {cell['batch']} | {mean_length:.0f} | {base:.0f} | "
            + " | ".join(f"{variants[name].rate / base:.2f}x" for name in names)
            + f" | {auto.rate / base:.2f}x (k={'/'.join(map(str, auto.chosen))}) | {auto.rate / best_fixed:.2f} | "
            + f"{auto.paired(variants['k=0']):.2f}, {auto.paired(best_variant):.2f} | "
            + f"{chosen / base:.2f}, {chosen / best_fixed:.2f} | "
            + f"{interval(variants[CONTROL], variants['k=0'])} | "
            + ", ".join(f"{variants[name].rate_by(other) / variants['k=0'].rate_by(other):.2f}x" for name in [*names, "auto"])
            + " | "
            + " / ".join(f"{rate:.0f}%" for rate in deepest.acceptance())
            + " |"
        )
    return "\n".join(lines)


def auto_summary(cells: list[dict], args) -> str:
    """The issue's goals in one line: auto's worst ratio against k = 0 and against the best fixed k."""
    names = ["k=0", *[f"k={k}" for k in range(1, args.mtp_layers + 1)]]
    against_k0, against_best, paired_k0, paired_best, control, choices = [], [], [], [], [], []
    for cell in cells:
        variants = {variant.name: variant for variant in cell["variants"]}
        auto, best = variants["auto"], max((variants[name] for name in names), key=lambda variant: variant.rate)
        against_k0.append(auto.rate / variants["k=0"].rate)
        against_best.append(auto.rate / best.rate)
        paired_k0.append((auto.paired(variants["k=0"]), interval(auto, variants["k=0"])))
        paired_best.append((auto.paired(best), interval(auto, best)))
        control.append((variants[CONTROL].paired(variants["k=0"]), interval(variants[CONTROL], variants["k=0"])))
        choices.append(choices_valued(auto, variants) / best.rate)
    worst = [min(pairs)[1] for pairs in (paired_k0, paired_best, control)]
    farthest_control = max(control, key=lambda pair: abs(pair[0] - 1.0))[1]
    return (f"\nauto, worst cell: {min(against_k0):.2f}x k = 0, {min(against_best):.2f}x the best fixed k "
            f"(goal: both >= 0.97); median cell: {statistics.median(against_k0):.2f}x, {statistics.median(against_best):.2f}x"
            f"\npaired per repeat (median, lowest-highest), worst cell: {worst[0]} x k = 0, {worst[1]} x the best fixed k; "
            f"A/A control ({CONTROL} vs k=0, the same work twice): worst cell {worst[2]}, farthest from 1 {farthest_control}"
            f"\nauto's choices alone (its runs' k at the fixed engines' median tokens/s), worst cell: {min(choices):.2f} "
            "x the best fixed k")


def choices_valued(auto: Variant, variants: dict[str, Variant]) -> float:
    """The tokens/s auto's timed runs would have had at the k it chose, each run at that k's fixed
    engine's median: what its decisions are worth apart from its own rollouts' timing noise (and
    its switches). Every run generates the same tokens, so the rate of the runs together is the
    harmonic mean of their rates."""
    return len(auto.chosen) / sum(1.0 / variants[f"k={k}"].rate for k in auto.chosen)


def interval(variant: Variant, other: Variant) -> str:
    """Paired median and its interval (:meth:`Variant.paired_ratios`), e.g. ``0.98 (0.91-1.04)``."""
    ratios = variant.paired_ratios(other)
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


BREAKDOWN_COLUMNS = ["trunk", "trunk attention", "drafts", "draft attention", "verification", "bookkeeping", "engine bookkeeping"]


def breakdown_table(cells: list[dict], args) -> str:
    """ms per engine step (prefill included) by phase; "other" is the rest of the step."""
    header = ["heads", "new tokens", "prompts", "k", "tokens per request-step", *BREAKDOWN_COLUMNS, "other", "step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in cells:
        for variant in cell["variants"][: args.mtp_layers + 1]:
            ms = variant.per_step_ms()
            phases = sum(ms.get(name, 0.0) for name in ("trunk", "drafts", "verification", "bookkeeping", "engine bookkeeping"))
            per_step = speculation_metrics(variant.output).get("rollout/tokens_per_decode_step", 1.0)
            lines.append(
                f"| {cell['heads']} | {cell['new_tokens']} | {cell['batch']} | {variant.name[2:]} | {per_step:.2f} | "
                + " | ".join(f"{ms.get(name, 0.0):.2f}" for name in BREAKDOWN_COLUMNS)
                + f" | {ms['step'] - phases:.2f} | {ms['step']:.2f} |"
            )
    return "\n".join(lines)


def same_responses(policy, args, phases_of: dict) -> str:
    """k = 0 under growing budgets with the random policy and its end-of-sequence token: the same
    responses (checked) whatever the budget; their tokens/s, against the smallest budget. The
    responses are short (the end is one of 14 tokens), so the largest batch and at least 9 runs."""
    batch = max(args.batches)
    variants = [Variant(f"{new_tokens}", RolloutEngine(policy, config(args, 0, new_tokens, batch))) for new_tokens in args.new_tokens]
    prompts, _ = counting_task(batch, 1, torch.Generator().manual_seed(batch))
    for repeat in range(max(args.repeats, 9)):
        run_in_turn(variants, prompts, repeat, phases_of, responses_end=True)
    same = all(torch.equal(variants[0].output["tokens"], variant.output["tokens"]) for variant in variants[1:])
    mean_length = variants[0].tokens / batch
    header = "| prompts | response tokens (mean) | " + " | ".join(f"{v.name} new tokens" for v in variants) + " | same responses |"
    row = f"| {batch} | {mean_length:.0f} | " + " | ".join(f"{v.rate:.0f} ({v.rate / variants[0].rate:.2f})" for v in variants)
    return "\n".join([header, "|" + "---|" * (len(variants) + 3), row + f" | {'yes' if same else 'no'} |"])


def draft_cost_table(cells: list[dict], args) -> str:
    """Trained heads, k = mtp_layers: the drafts' ms per step, and the part that is attention over
    the MTP caches, per budget (responses fill it), against the shortest."""
    name = f"k={args.mtp_layers}"
    lines = ["| prompts | new tokens | drafts ms/step | vs shortest | drafts less cache attention | vs shortest |", "|---|---|---|---|---|---|"]
    for batch in sorted({cell["batch"] for cell in cells}):
        row = [cell for cell in cells if cell["batch"] == batch]
        first = None
        for cell in row:
            ms = next(v for v in cell["variants"] if v.name == name).per_step_ms()
            drafts, rest = ms.get("drafts", 0.0), ms.get("drafts", 0.0) - ms.get("draft attention", 0.0)
            first = first or (drafts, rest)
            lines.append(f"| {batch} | {cell['new_tokens']} | {drafts:.2f} | {drafts / first[0]:.2f}x | {rest:.2f} | {rest / first[1]:.2f}x |")
    return "\n".join(lines)


def memory_table(cells: list[dict], args) -> str:
    lines = ["| new tokens | prompts | buffer (MiB) | decoder KV (MiB) | MTP caches (MiB) |", "|---|---|---|---|---|"]
    for cell in cells:
        trunk, mtp = cell["memory"]["trunk"] / 2**20, cell["memory"]["mtp"] / 2**20
        lines.append(f"| {cell['new_tokens']} | {cell['batch']} | {trunk + mtp:.1f} | {trunk:.1f} | {mtp:.1f} |")
    return "\n".join(lines)


def figure(cells: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"k={k}" for k in range(1, args.mtp_layers + 1)] + ["auto"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for axis, heads in zip(axes, ("untrained", "trained")):
        chosen = [cell for cell in cells if cell["heads"] == heads]
        labels = [f"{cell['new_tokens']}\n{cell['batch']}p" for cell in chosen]
        width = 0.8 / len(names)
        for index, name in enumerate(names):
            ratios = []
            for cell in chosen:
                variants = {variant.name: variant for variant in cell["variants"]}
                ratios.append(variants[name].rate / variants["k=0"].rate)
            axis.bar([i + (index - (len(names) - 1) / 2) * width for i in range(len(chosen))], ratios, width, label=name)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(range(len(chosen)), labels, fontsize=8)
        axis.set_title(f"{heads} heads")
        axis.set_xlabel("max new tokens / prompts")
    axes[0].set_ylabel("tokens/s vs k=0")
    axes[1].legend()
    fig.suptitle("Rollout throughput with MTP speculation (CPU, tiny model, temperature 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--mtp-layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--train-length", type=int, default=128, help="answer digits of the imitation task")
    parser.add_argument("--train-batch", type=int, default=64)
    parser.add_argument("--figure", type=Path, default=None, help="draw the cells to this PNG (none drawn without it)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="what the tables time with")
    parser.add_argument("--turn-ms", type=float, default=1000 * TURN_SECONDS[0], help="how long each variant steps before the next one's turn")
    parser.add_argument("--beside-load", action="store_true", help="run a second CPU-bound process (a one-thread matmul loop) beside the benchmark")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    print(as_the_workers_run(), flush=True)
    CLOCK_NAME[0] = args.clock
    TURN_SECONDS[0] = args.turn_ms / 1000
    with beside_load() if args.beside_load else contextlib.nullcontext():
        run_benchmark(args)


@contextlib.contextmanager
def beside_load():
    """A second CPU-bound process for the whole benchmark: a 512 x 512 float32 matmul loop on one
    thread, as another job sharing the machine would be; ended afterwards, and ending itself when
    the benchmark's process is gone (killed, the benchmark's cleanup never ran: once it went on
    for 50 minutes, beside runs meant to be quiet)."""
    import os
    import subprocess
    import sys

    loop = (
        f"import os, torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile os.getppid() == {os.getpid()}:\n"
        "    for _ in range(100):\n        a = torch.tanh(a @ a)"
    )
    process = subprocess.Popen([sys.executable, "-c", loop])
    print(f"a second CPU-bound process runs beside the benchmark (pid {process.pid}: a one-thread 512x512 matmul loop)", flush=True)
    try:
        yield
    finally:
        process.kill()
        process.wait()


def benchmark_policy(base):
    """The policy model of ``base`` (a policy config) in a one-process megatron world, its process
    set up as a policy worker's is (freed memory kept, the start-up heap frozen)."""
    initialize_model_parallel(base.megatron_cfg, 0, 1, f"tcp://127.0.0.1:{free_port()}")
    torch.manual_seed(base.megatron_cfg.seed)
    policy = setup_megatron_policy(base, TOKENIZER.vocab_size)
    keep_freed_host_memory()
    freeze_startup_heap()
    return policy


def train_heads(policy, args, base) -> dict:
    """``args.train_steps`` imitation steps of the counting task (``args.train_batch`` answers of
    ``args.train_length`` digits), which train policy and heads alike; the last step's metrics."""
    generator, metrics = torch.Generator().manual_seed(0), {}
    for _ in range(args.train_steps):
        demonstrations = demonstration_batch(*counting_task(args.train_batch, args.train_length, generator), TOKENIZER.pad_id)
        metrics = imitation_step(policy, demonstrations, base)
    return metrics


def run_benchmark(args) -> None:

    base = config(args, 0, max(args.new_tokens + [args.train_length]), args.train_batch)
    policy = benchmark_policy(base)
    phases_of = {}
    attention_timers(phases_of)
    print(f"{torch.get_num_threads()} torch thread(s); median of {args.repeats} runs per variant, the variants stepped in turns of {args.turn_ms:g} ms; {args.clock} clock", flush=True)

    budgets = same_responses(policy, args, phases_of)
    cells = []
    for heads in ("untrained", "trained"):
        if heads == "trained":
            metrics = train_heads(policy, args, base)
            shown = ", ".join(f"{metrics[f'mtp/mtp_{i}_acceptance_rate']:.0f}%" for i in range(1, args.mtp_layers + 1))
            print(f"after {args.train_steps} imitation steps: training-side MTP acceptance {shown}", flush=True)
        for new_tokens in args.new_tokens:
            for batch in args.batches:
                cells.append(run_cell(policy, args, heads, new_tokens, batch, phases_of))

    trained = [cell for cell in cells if cell["heads"] == "trained"]
    print("\n## Tokens/s against k = 0\n")
    print(throughput_table(cells, args))
    print(auto_summary(cells, args))
    print("\n## Where a step goes (ms per engine step)\n")
    print(breakdown_table(cells, args))
    print("\n## k = 0 with the same responses under growing budgets (random policy; tokens/s, vs the smallest budget)\n")
    print(budgets)
    print(f"\n## Drafts' cost per step against the response length (trained heads, k = {args.mtp_layers})\n")
    print(draft_cost_table(trained, args))
    print(f"\n## KV memory of the engine at k = {args.mtp_layers} (MTP caches inside the buffer)\n")
    print(memory_table(trained, args))
    if args.figure is not None:
        figure(cells, args, args.figure)
        print(f"\nfigure: {args.figure}")


if __name__ == "__main__":
    main()
