"""Measured time of eager training steps of zoo models under a plan's selective checkpointing,
on the device at hand (a GPU, or this CPU): what ``scripts/time_check.py`` reports and what
the budget ranking test (``tests/test_budget_ranking.py``) ranks.

A step is ``loss = model(*inputs)`` then ``torch.autograd.grad(loss, params)``, every layer
under non-reentrant ``torch.utils.checkpoint`` with the plan's SAC policies (no plan: no
checkpointing), the device synchronised before and after it. Forward is split from backward
by a device event (the host clock on a CPU); replay is the time inside the layers' recomputes
during backward (device events around each recompute on CUDA: the device's time between the
recompute's first and last work).

Configurations are measured interleaved: each round runs one step of every configuration, in
an order shuffled anew each round, and a configuration's figure is its median over the
rounds. A machine whose speed drifts (a shared VM drifts by 20-30% within a minute) then slows
every configuration alike, so the differences between them survive, where blocks of steps of
one configuration after another would mix the drift into them.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import _measure as measure
from . import sac
from ._zoo.catalog import declared_units, entry, make_inputs, model_decls
from ._zoo.config import ZooConfig
from ._zoo.model import CausalLM
from .api import plan as make_plan
from .model_export import export
from .plans import Plan


class Clock:
    """Times regions of work on ``device``: device events on CUDA (read after a synchronise),
    the host clock elsewhere (every CPU op has finished when it returns)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)


class ReplayTimer:
    """Wraps a layer's forward (inside its checkpoint) to time the calls autograd makes while
    it runs backward: the layer's recomputes. A recompute that stops early (non-reentrant
    checkpointing stops once backward has what it needs) is timed up to where it stopped."""

    def __init__(self, clock: Clock, device: torch.device):
        self.clock = clock
        self.device = device
        self.spans: list[tuple[Any, Any]] = []

    def wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if torch._C._current_graph_task_id() == -1:
                return forward(*args, **kwargs)  # forward: under the step's device mode
            start = self.clock.mark()
            try:
                # Factories in the layer default to the device in its recompute too, which
                # runs on autograd's thread.
                with torch.device(self.device):
                    return forward(*args, **kwargs)
            finally:
                self.spans.append((start, self.clock.mark()))

        return timed

    def take(self) -> float:
        """Seconds in the recomputes since the last ``take`` (after a synchronise)."""
        total = sum(self.clock.seconds(start, end) for start, end in self.spans)
        self.spans.clear()
        return total


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one step (or medians over steps): forward + backward = step; replay is
    inside backward."""

    step_s: float
    forward_s: float
    backward_s: float
    replay_s: float


class TimedStep:
    """A model's training step, timed: its loss (``loss``, for the subclass to define), then
    the gradients of ``params``; its layers' recomputes timed by ``timer`` where the subclass
    wrapped their forwards with it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.clock = Clock(device)
        self.timer = ReplayTimer(self.clock, device)
        self.params: list[torch.Tensor] = []

    def loss(self) -> torch.Tensor:
        raise NotImplementedError

    def run(self) -> StepTimes:
        """One step, timed."""
        self.clock.sync()
        start = self.clock.mark()
        loss = self.loss()
        middle = self.clock.mark()
        torch.autograd.grad(loss, self.params, allow_unused=True)
        end = self.clock.mark()
        self.clock.sync()
        forward, backward = self.clock.seconds(start, middle), self.clock.seconds(middle, end)
        return StepTimes(forward + backward, forward, backward, self.timer.take())


class ZooStep(TimedStep):
    """A fresh seeded zoo model on ``device`` whose layers are checkpointed with ``plan``'s
    policies (``None``: no checkpointing), ready to run timed steps."""

    def __init__(self, cfg: ZooConfig, device: torch.device, plan: Plan | None):
        super().__init__(device)
        self.model = CausalLM(cfg).to(device)
        self.inputs = tuple(t.to(device) for t in make_inputs(cfg))
        if plan is not None:
            # Replaced on the instances, as sac.checkpoint_module replaces a forward.
            for layer in self.model.layers:
                layer.forward = self.timer.wrap(layer.forward)
            mtp = self.model.mtp
            if mtp is not None:
                mtp.layer_forward = self.timer.wrap(mtp.layer_forward)  # type: ignore[method-assign]
            policies: dict[tuple[str, int], sac.ContextFn] = {
                key: sac.context_fn(plan, *key) for key in plan.layers()
            }
            measure.checkpoint_zoo_layers(self.model, policies)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    @property
    def input_bytes(self) -> int:
        return sum(measure.tensor_bytes(t) for t in self.inputs)

    def loss(self) -> torch.Tensor:
        with torch.device(self.device):
            loss: torch.Tensor = self.model(*self.inputs)
        return loss


def interleaved(
    steps: Mapping[str, TimedStep], rounds: int, *, warmup: int = 2, seed: int = 0
) -> dict[str, list[StepTimes]]:
    """Each configuration's times in ``rounds`` rounds of one step of every configuration, in
    an order shuffled each round (after ``warmup`` untimed steps of each): the i-th time of
    every configuration comes from the same round."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    for step in steps.values():
        for _ in range(warmup):
            step.run()
    order = random.Random(seed)
    runs: dict[str, list[StepTimes]] = {name: [] for name in steps}
    for _ in range(rounds):
        names = list(steps)
        order.shuffle(names)
        for name in names:
            runs[name].append(steps[name].run())
    return runs


def median(times: list[StepTimes]) -> StepTimes:
    """Each figure's median over ``times`` (a step's median is not forward's plus
    backward's)."""
    return StepTimes(
        step_s=statistics.median(t.step_s for t in times),
        forward_s=statistics.median(t.forward_s for t in times),
        backward_s=statistics.median(t.backward_s for t in times),
        replay_s=statistics.median(t.replay_s for t in times),
    )


# --------------------------------------------------------------------------------------------
# A budget's answer ranked by measured time


@dataclass(frozen=True)
class Ranked:
    """One configuration of a budget ranking: its label, its plan (planned with the ranking's
    profile), its measured times (medians over the rounds) and its step against the answer's:
    the median over the rounds of its step over the answer's step in the same round, less 1
    (-0.02: 2% faster than the answer), which leaves out drift slower than a round."""

    label: str
    plan: Plan
    times: StepTimes
    vs_answer: float


def peak(plan: Plan) -> int:
    """The plan's predicted peak (a joint graph's plan always has one)."""
    if plan.memory.peak_bytes is None:
        raise ValueError("the plan predicts no peak: the graph is not a joint graph")
    return plan.memory.peak_bytes


def kept(plan: Plan) -> tuple[tuple[str, str, int], ...]:
    """What a plan keeps: (model, unit, layer) of every kept unit, sorted."""
    return tuple(sorted((u.model, u.unit, layer.layer) for u in plan.units for layer in u.layers))


def random_mixes(plan: Plan, units: list[str], count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` per-layer choices (``plan(choices=...)``) over the layers ``plan``
    checkpoints, each layer keeping each unit with probability one half."""
    draw = random.Random(seed)
    return [
        {
            "layer_keep": [
                {"model": model, "layer": layer, "keep": [u for u in units if draw.random() < 0.5]}
                for model, layer in plan.layers()
            ]
        }
        for _ in range(count)
    ]


def budget_candidates(
    graph: bytes,
    units: list[str],
    budget: int,
    hw: Any,
    rivals: Mapping[str, Any],
    mixes: int,
    seed: int,
) -> dict[str, Plan]:
    """The ``budget`` answer planned with ``hw`` (first, labelled ``answer``), then every
    other configuration whose peak fits the budget, each planned with ``hw``: the answers
    with the ``rivals`` profiles (labelled by their name), every uniform keep and ``mixes``
    random per-layer mixes; a configuration that keeps what an earlier one keeps is left
    out."""

    def planned(**options: Any) -> Plan:
        return make_plan(graph, executor="eager", hw=hw, check=False, **options)

    answer = planned(budget=budget)
    if peak(answer) > budget:
        raise ValueError(f"the answer's peak {peak(answer):,} B is above its budget {budget:,} B")
    found: dict[str, Plan] = {"answer": answer}
    for name, rival in rivals.items():
        rival_answer = make_plan(graph, executor="eager", hw=rival, budget=budget, check=False)
        found[f"{name} answer"] = planned(choices=rival_answer)
    for keep in ["none", *units, "all"]:
        found[keep] = planned(keep=keep)
    for i, choices in enumerate(random_mixes(answer, units, mixes, seed)):
        found[f"mix {i}"] = planned(choices=choices)
    seen: set[tuple[tuple[str, str, int], ...]] = set()
    fitting = {}
    for label, candidate in found.items():
        if peak(candidate) <= budget and kept(candidate) not in seen:
            seen.add(kept(candidate))
            fitting[label] = candidate
    return fitting


def distinguishing_budget(graph: bytes, hw: Any, rival: Any, points: int) -> tuple[int, float]:
    """Of ``points`` budgets evenly between the peaks of keeping nothing and keeping
    everything, the one where ``rival``'s answer is predicted slowest (with ``hw``) against
    ``hw``'s own answer, where a ranking by measured time tells the two profiles apart; and
    that predicted gap (0 where the two answer alike at every budget: then the midpoint)."""

    def planned(**options: Any) -> Plan:
        return make_plan(graph, executor="eager", check=False, **options)

    low, high = peak(planned(keep="none", hw=hw)), peak(planned(keep="all", hw=hw))
    best, best_gap = (low + high) // 2, 0.0
    for i in range(1, points + 1):
        budget = low + (high - low) * i // (points + 1)
        own = planned(budget=budget, hw=hw)
        theirs = planned(choices=planned(budget=budget, hw=rival), hw=hw)
        gap = theirs.cost.step_time_s / own.cost.step_time_s - 1
        if gap > best_gap:
            best, best_gap = budget, gap
    return best, best_gap


# Zoo models whose budget answers are ranked by measured time on a CPU (the budget ranking
# test, `scripts/time_check.py rank`): four layers of 256 wide, batch 2 x 256 tokens (the
# MoE's capacity scaled with them), where a layer's replay is milliseconds of matmuls; (zoo
# entry, changes, rounds). The MoE's step varies more from one run to the next (two copies of
# one configuration differed by 3% over 7 rounds, by under 1% over 13).
_CPU_WIDE = dict(hidden=256, heads=4, head_dim=64, vocab=2048, batch=2, seq=256, num_layers=4)
RANKING_CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "dense": ("dense", dict(_CPU_WIDE, ffn=2048), 7),
    "moe": ("moe_hf_router", dict(_CPU_WIDE, moe_ffn=512, shared_ffn=256), 13),
    "mla": ("dsv3_kv_expand", dict(_CPU_WIDE, ffn=1024), 7),
}
DATASHEET = "h200"


@dataclass(frozen=True)
class RankingCase:
    """A ranking case made ready: its config, the budget, what fits it (the answer first), and
    how much slower the datasheet's answer is predicted there (0: the same answer)."""

    cfg: ZooConfig
    budget: int
    candidates: dict[str, Plan]
    datasheet_gap: float


def traced_case(case: str) -> tuple[ZooConfig, bytes]:
    """``RANKING_CASES[case]``'s config and its training step traced (fake tensors, CPU)."""
    name, changes, _ = RANKING_CASES[case]
    cfg = entry(name).config.resized(**changes)
    graph = export(
        CausalLM(cfg), make_inputs(cfg), models=model_decls(cfg), name=name, fake=True
    ).graph.SerializeToString()
    return cfg, graph


def ranking_case(case: str, hw: Any, mixes: int = 10, seed: int = 0) -> RankingCase:
    """``RANKING_CASES[case]`` traced, at its distinguishing budget against the datasheet,
    with the candidates planned with ``hw``."""
    cfg, graph = traced_case(case)
    budget, gap = distinguishing_budget(graph, hw, DATASHEET, points=24)
    fitting = budget_candidates(
        graph, list(declared_units(cfg)), budget, hw, {"datasheet": DATASHEET}, mixes, seed
    )
    return RankingCase(cfg, budget, fitting, gap)


def rank_budget_answer(
    cfg: ZooConfig,
    candidates: Mapping[str, Plan],
    device: torch.device,
    rounds: int,
    seed: int = 0,
) -> list[Ranked]:
    """``candidates`` (``budget_candidates``, the answer labelled ``answer``) measured
    interleaved, fastest first by their step against the answer's."""
    steps = {label: ZooStep(cfg, device, plan) for label, plan in candidates.items()}
    runs = interleaved(steps, rounds, seed=seed)
    answer = runs["answer"]
    ranked = [
        Ranked(
            label,
            candidates[label],
            median(times),
            statistics.median(t.step_s / a.step_s for t, a in zip(times, answer, strict=True)) - 1,
        )
        for label, times in runs.items()
    ]
    return sorted(ranked, key=lambda r: r.vs_answer)
