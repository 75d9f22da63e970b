//! `--budget SIZE`: per checkpointed layer, the set of units that minimises predicted
//! replay time with the predicted peak within the budget, and the frontier `planner pareto`
//! prints.
//!
//! Method:
//! 1. Options are exact: every subset of a model's declared units. Each is planned once in
//!    every checkpointed layer of its model at the same time (a *run*: `2^units` per model,
//!    in parallel), and each layer's contribution under it is read off the run: its replay,
//!    replay seconds, the values it makes resident and its storages' lifetimes
//!    ([`crate::compose`]). A choice of one option per layer is then simulated exactly by
//!    composing contributions, without planning it: changing one layer's option costs that
//!    layer's storages times log(steps).
//! 2. The frontier ([`crate::explore`]): every combination when there are at most
//!    [`EXHAUSTIVE_LIMIT`] (exact), else a greedy path ranked by simulated peak, a knapsack
//!    sweep over the linear peak model, every uniform `--keep`, and the choices between
//!    frontier points left too far apart; the candidates no other beats, thinned so that
//!    consecutive points are at most `1/steps` of the peak range apart.
//! 3. `--budget` answers the fastest point of the frontier of [`DEFAULT_STEPS`] (what
//!    `pareto` prints by default) whose peak fits, planned in full and verified. So a larger
//!    budget never answers slower, no answer lies below the `pareto` frontier, the answer
//!    always fits and is never a configuration `plan` rejects, and, when the graph declares
//!    at most [`MAX_UNITS`] unit names, it is never slower than the best uniform `--keep`
//!    that fits (every uniform choice on the frontier stays on it).
//!
//! Optimality gap: exact up to [`EXHAUSTIVE_LIMIT`] combinations. Beyond, against every
//! combination simulated by the composed model, over 65 budgets from the smallest peak to the
//! largest, the answer's replay time was on average 0.21% and at worst 1.95% above the optimum
//! on the MoE golden deepened to 3 layers (4096 combinations; `tests/budget.rs` checks it
//! within 2.5%), mean 0.05% and at worst 1.74% at 4 layers (65536). (With each layer's replay
//! run at once, before replay was scheduled op by op, the same figures were 0.00%, and 0.29% at
//! 4 layers: each op replayed at its first use makes the layers' peaks interact more than the
//! linear peak model assumes.) The local steps stop at local optima, so the gap is not bounded
//! in general; and an
//! answer is a frontier point, so on deep graphs a budget between two points gets the lower
//! one (at most `1/steps` of the peak range below the budget).

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::OnceLock,
};

use ir::{
    plan::{Keep, LayerRef, Plan},
    EntityId, Graph, ModelId, NodeId, Phase, UnitId,
};
use rayon::prelude::*;

use crate::{
    compose::{Figures, Layers, Model, Run},
    config::{self, PlanConfig, Resolved},
    cost::{HwProfile, NodeWork},
    explore::{self, Candidate, Explorer, Knapsack},
    partition,
    plan::{self, Baselines, PlanError},
    policy,
    progress::{Progress, Silent},
};

pub use crate::explore::{BUCKETS, EXHAUSTIVE_LIMIT};

/// Models with more units than this are not searched (2^units runs each).
pub const MAX_UNITS: usize = 8;
/// Rounds of filling the frontier's wide gaps.
const FILL_ROUNDS: usize = 8;
/// The frontier's density by default (`pareto --steps`): consecutive points at most 1/32 of
/// the peak range apart.
pub const DEFAULT_STEPS: u64 = 32;

#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("budget {budget} B is below the smallest peak the search found, {smallest} B; raise the budget or --recompute-ratio")]
    Infeasible { budget: u64, smallest: u64 },
    #[error("--budget needs a joint forward+backward graph (this one has no backward nodes)")]
    NotJoint,
    #[error(
        "model `{model}` declares {units} units; the exact search handles at most {MAX_UNITS}"
    )]
    TooManyUnits { model: String, units: usize },
    #[error("the search was interrupted")]
    Interrupted,
    #[error("--budget takes no --offload or --offload-kinds: with --budget-offload it chooses per layer which kept units to offload itself; or offload without --budget")]
    Offload,
    #[error("--budget-offload chooses whole units per layer: use it with --granularity unit")]
    OffloadOps,
}

/// Stops a search its caller interrupted.
fn check_interrupt(progress: &dyn Progress) -> Result<(), BudgetError> {
    if progress.interrupted() {
        Err(BudgetError::Interrupted)
    } else {
        Ok(())
    }
}

/// A candidate answer for `budget`: its peak fits and `plan` accepts it (no error).
fn fits(plan: &Plan, budget: u64) -> bool {
    plan.memory.peak_bytes.unwrap_or(0) <= budget && !plan.has_errors()
}

/// A point of the frontier: a choice of units per layer and the figures its full plan has.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub figures: Figures,
    /// One option (a unit bitmask) per searched layer.
    choice: Vec<u8>,
}

/// Everything the solver needs: the layers it chooses units for, each one's contribution
/// under each option, and the plan keeping nothing.
pub struct Search<'g> {
    graph: &'g Graph,
    base: PlanConfig,
    hw: &'g HwProfile,
    resolved: Resolved,
    /// Computed once: every full plan shares them.
    baselines: Baselines,
    layers: Layers,
    model: Model,
    work: NodeWork,
    progress: &'g dyn Progress,
    /// The frontier `--budget` answers from ([`DEFAULT_STEPS`]), once found.
    default_frontier: OnceLock<Vec<Point>>,
}

impl<'g> Search<'g> {
    /// Plans every unit subset of every model once (2^units runs per model).
    pub fn new(
        graph: &'g Graph,
        config: &PlanConfig,
        hw: &'g HwProfile,
    ) -> Result<Self, BudgetError> {
        Search::with_progress(graph, config, hw, &Silent)
    }

    /// [`Search::new`], reporting each run and each full plan to `progress`.
    pub fn with_progress(
        graph: &'g Graph,
        config: &PlanConfig,
        hw: &'g HwProfile,
        progress: &'g dyn Progress,
    ) -> Result<Self, BudgetError> {
        // The composed figures the search compares do not model offload.
        if config.offload.is_asked() {
            return Err(BudgetError::Offload);
        }
        let base = PlanConfig {
            keep: Keep::Nothing,
            ..config.clone()
        };
        let resolved = config::resolve(graph, &base).map_err(PlanError::from)?;
        if !partition::is_joint(graph) {
            return Err(BudgetError::NotJoint);
        }
        let layers = Layers::new(graph, searched_layers(graph, &resolved));
        let jobs = runs_of(graph, &layers)?;
        progress.stage("option tables", Some(jobs.len() as u64 + 1));
        let work = NodeWork::of(graph, hw, config.executor, |n| {
            resolved.is_checkpointed(n.model, n.layer)
        });
        let (baselines, runs) = rayon::join(
            || {
                let baselines = Baselines::of(graph, config.executor);
                progress.advance();
                baselines
            },
            || {
                jobs.par_iter()
                    .map(|&(model, option)| {
                        check_interrupt(progress)?;
                        let run = run(graph, &base, &resolved, &layers, (model, option), &work);
                        progress.advance();
                        Ok(run)
                    })
                    .collect::<Result<Vec<Run>, BudgetError>>()
            },
        );
        let (baselines, runs) = (baselines?, runs?);
        progress.stage("composing", None);
        let model = Model::new(graph, &layers, runs, &work);
        Ok(Search {
            graph,
            base,
            hw,
            resolved,
            baselines,
            layers,
            model,
            work,
            progress,
            default_frontier: OnceLock::new(),
        })
    }

    /// Reports the start of a search stage.
    pub fn stage(&self, what: &str, total: Option<u64>) {
        self.progress.stage(what, total);
    }

    /// The smallest achievable peak: the first point of the default frontier (keeping
    /// nothing if no choice is allowed).
    pub fn floor(&self) -> Result<u64, BudgetError> {
        match self.frontier(DEFAULT_STEPS)?.first() {
            Some(point) => Ok(point.figures.peak_bytes),
            None => Ok(self.nothing()?.memory.peak_bytes.unwrap_or(0)),
        }
    }

    /// The plan keeping nothing.
    pub fn nothing(&self) -> Result<Plan, BudgetError> {
        self.plan_of(&vec![0; self.layers.at.len()])
    }

    /// Per-layer option combinations: the product of the option counts.
    pub fn combinations(&self) -> u64 {
        self.model
            .options
            .iter()
            .fold(1u64, |acc, o| acc.saturating_mul(o.len() as u64))
    }

    /// Whether the composed figures are exact; when they are not, every figure shown comes
    /// from a full plan.
    pub fn exact(&self) -> bool {
        self.model.exact()
    }

    /// The composed figures of per-layer unit choices (layers not named keep nothing), what
    /// a full plan of each reports when the model is exact; none for a choice with a rejected
    /// option. One composer walks through them in order, as a search does: from one choice
    /// to the next it changes the layers that differ, one at a time (or recomputes every
    /// slot when most do).
    pub fn composed(&self, choices: &[BTreeMap<LayerRef, Vec<UnitId>>]) -> Vec<Option<Figures>> {
        let mut composer = crate::compose::Composer::new(&self.model);
        choices
            .iter()
            .map(|layer_keep| {
                let choice: Vec<u8> = self
                    .layers
                    .at
                    .iter()
                    .map(|at| {
                        layer_keep
                            .get(at)
                            .map_or(0, |units| units.iter().fold(0u8, |o, u| o | 1 << u.index()))
                    })
                    .collect();
                composer.set(&choice);
                self.model.allowed(&choice).then(|| {
                    self.model
                        .figures(self.graph, &self.work, &choice, composer.peak())
                })
            })
            .collect()
    }

    /// The frontier of density `steps`: the points no candidate beats, by increasing peak.
    pub fn frontier(&self, steps: u64) -> Result<Vec<Point>, BudgetError> {
        if steps == DEFAULT_STEPS {
            if let Some(front) = self.default_frontier.get() {
                return Ok(front.clone());
            }
        }
        let front = self.find_frontier(steps)?;
        if steps == DEFAULT_STEPS {
            let _ = self.default_frontier.set(front.clone());
        }
        Ok(front)
    }

    fn find_frontier(&self, steps: u64) -> Result<Vec<Point>, BudgetError> {
        let mut explorer = Explorer::new(&self.model);
        let candidates = if explorer.combinations() <= EXHAUSTIVE_LIMIT {
            self.stage("every combination", None);
            explorer.every_combination();
            explorer.unthinned().to_vec()
        } else {
            self.stage("frontier", None);
            self.explore(&mut explorer, steps);
            explorer.frontier(steps)
        };
        self.points(candidates)
    }

    /// The candidates of a large search (see [`crate::explore`]).
    fn explore(&self, explorer: &mut Explorer, steps: u64) {
        explorer.greedy_path();
        let max = explore::max_headroom(&self.model);
        let knapsack = Knapsack::solve(&self.model.options, max);
        let sweep = (steps.max(1) * 2).min(BUCKETS);
        let mut choices: Vec<Vec<u8>> = (0..=sweep)
            .map(|k| {
                let headroom = u128::from(max) * u128::from(k) / u128::from(sweep);
                knapsack.choice(u64::try_from(headroom).unwrap_or(max))
            })
            .collect();
        choices.dedup();
        for choice in choices {
            explorer.visit(&choice, false);
        }
        for choice in self.uniform_choices() {
            explorer.visit(&choice, true);
        }
        // Filling a gap can leave narrower gaps between new points: fill those too.
        let mut filled: Vec<(Candidate, Candidate)> = Vec::new();
        for _ in 0..FILL_ROUNDS {
            let gaps: Vec<_> = explore::wide_gaps(&explorer.frontier(steps), steps)
                .into_iter()
                .filter(|gap| !filled.contains(gap))
                .collect();
            if gaps.is_empty() {
                break;
            }
            for (a, b) in gaps {
                explorer.between(&a.choice, &b.choice);
                explorer.fill(&a, &b);
                filled.push((a, b));
            }
        }
    }

    /// The frontier points of `candidates`, with the figures their full plans report: composed
    /// when the model is exact, else planned (and those `plan` rejects dropped).
    fn points(&self, candidates: Vec<Candidate>) -> Result<Vec<Point>, BudgetError> {
        if self.model.exact() {
            return Ok(candidates
                .into_par_iter()
                .map(|c| Point {
                    figures: self
                        .model
                        .figures(self.graph, &self.work, &c.choice, c.peak),
                    choice: c.choice,
                })
                .collect());
        }
        let planned: Vec<Option<Point>> = candidates
            .into_par_iter()
            .map(|c| -> Result<_, BudgetError> {
                let plan = self.plan_of(&c.choice)?;
                Ok((!plan.has_errors()).then(|| Point {
                    figures: figures_of(&plan),
                    choice: c.choice,
                }))
            })
            .collect::<Result<_, _>>()?;
        let points: Vec<Point> = planned.into_iter().flatten().collect();
        let mut front: Vec<Point> = points
            .iter()
            .filter(|p| !points.iter().any(|q| q.dominates(p)))
            .cloned()
            .collect();
        front.sort_by(|a, b| {
            a.figures
                .peak_bytes
                .cmp(&b.figures.peak_bytes)
                .then(a.figures.replay_time_s.total_cmp(&b.figures.replay_time_s))
        });
        front.dedup_by(|a, b| a.figures == b.figures);
        Ok(front)
    }

    /// The per-layer units of a point, as a plan's `layer_keep` states them.
    pub fn layer_keep(&self, point: &Point) -> Vec<ir::plan::LayerKeep> {
        self.layers
            .at
            .iter()
            .zip(&point.choice)
            .map(|(&at, &o)| ir::plan::LayerKeep {
                at,
                units: subset(usize::from(o)),
            })
            .collect()
    }

    /// The plan keeping, in each searched layer, the units of its option.
    fn plan_of(&self, choice: &[u8]) -> Result<Plan, BudgetError> {
        self.plan_resolved(self.resolved_of(choice))
    }

    /// The configuration keeping, in each searched layer, the units of its option.
    fn resolved_of(&self, choice: &[u8]) -> Resolved {
        let layer_units = self
            .layers
            .at
            .iter()
            .zip(choice)
            .map(|(&at, &o)| (at, subset(usize::from(o))))
            .collect();
        self.resolved.clone().with_layer_units(layer_units)
    }

    fn plan_resolved(&self, resolved: Resolved) -> Result<Plan, BudgetError> {
        check_interrupt(self.progress)?;
        self.progress.advance();
        let plan = plan::plan_against(self.graph, &self.base, resolved, self.hw, &self.baselines);
        Ok(plan?)
    }

    /// The plan of the fastest point of the default frontier whose peak fits `budget`,
    /// planned in full and verified (if its full plan does not fit, which only an inexact
    /// model allows, the next fastest point that fits; keeping nothing last, if it fits).
    pub fn within(&self, budget: u64) -> Result<Plan, BudgetError> {
        let front = self.frontier(DEFAULT_STEPS)?;
        self.check_floor(budget)?;
        self.stage("the answer", None);
        // The frontier's time decreases with its peak: the last point that fits is fastest.
        for point in front
            .iter()
            .rev()
            .filter(|p| p.figures.peak_bytes <= budget)
        {
            let plan = self.plan_of(&point.choice)?;
            if fits(&plan, budget) {
                return Ok(plan);
            }
        }
        // Only an inexact model gets here: keeping nothing is the last resort, and never an
        // answer that does not fit.
        let nothing = self.nothing()?;
        if fits(&nothing, budget) {
            return Ok(nothing);
        }
        Err(BudgetError::Infeasible {
            budget,
            smallest: nothing.memory.peak_bytes.unwrap_or(0),
        })
    }

    /// `--budget-offload`: the fastest plan that fits `budget` when the saved values of kept
    /// units and the layers' inputs may also go to host memory, chosen per layer and unit.
    /// Offloading layer inputs meets budgets below the smallest peak of save and recompute
    /// alone (whole-layer recompute keeps every layer's input on the device).
    ///
    /// Time is the plan's replay time plus its exposed transfer time (the copies compute does
    /// not hide). Offload changes no replay, so a frontier point can only gain by it where its
    /// peak is above the budget, and it never gets faster than its own replay time: the points
    /// above the budget are tried fastest first, until one's replay time alone is no faster
    /// than the best answer found (the answer without offload first, when one fits).
    ///
    /// For one point, its pairs (a layer and one of its kept units, or a layer and its inputs)
    /// are offloaded in up to three orders ([`Search::orders_of`]), each in layer order: an
    /// early layer's values stay saved the longest, and the most compute follows their copy to
    /// the host and precedes their first read in backward, so their copies are the easiest to
    /// hide. For each order the shortest prefix whose full plan fits is found by binary
    /// search, after checking the whole order fits (about `log2(pairs) + 1` plans per order and
    /// point; twice that when offloading them all overflows the host memory, which another
    /// binary search bounds), and the fastest of the orders' plans is the point's. Optimality
    /// gap: prefixes are not the cheapest subset in general (a later layer's smaller values may
    /// fit with less exposed time), and the binary search assumes that offloading more never
    /// raises the device peak.
    pub fn within_offloading(&self, budget: u64) -> Result<Plan, BudgetError> {
        let front = self.frontier(DEFAULT_STEPS)?;
        let mut best = match self.within(budget) {
            Ok(plan) => Some(plan),
            Err(BudgetError::Infeasible { .. }) => None,
            Err(e) => return Err(e),
        };
        self.stage("offload", None);
        // The smallest peak seen, for the error when nothing fits.
        let mut smallest = self.floor()?;
        for point in front.iter().rev().filter(|p| p.figures.peak_bytes > budget) {
            if best
                .as_ref()
                .is_some_and(|b| point.figures.replay_time_s >= step_cost(b))
            {
                break;
            }
            match self.offloaded_within(point, budget)? {
                Ok(plan) => {
                    if best
                        .as_ref()
                        .is_none_or(|b| step_cost(&plan) < step_cost(b))
                    {
                        best = Some(plan);
                    }
                }
                Err(peak) => smallest = smallest.min(peak),
            }
        }
        best.ok_or(BudgetError::Infeasible { budget, smallest })
    }

    /// The fastest plan of `point` with a prefix of one of its orders of pairs
    /// ([`Search::orders_of`]) offloaded that fits `budget`; else the smallest peak a prefix
    /// the host memory takes reaches (the point's own if none).
    fn offloaded_within(
        &self,
        point: &Point,
        budget: u64,
    ) -> Result<Result<Plan, u64>, BudgetError> {
        let mut best: Result<Plan, u64> = Err(point.figures.peak_bytes);
        for pairs in self.orders_of(point) {
            best = match (best, self.prefix_within(point, &pairs, budget)?) {
                (Ok(a), Ok(b)) => Ok(if step_cost(&b) < step_cost(&a) { b } else { a }),
                (Ok(a), Err(_)) | (Err(_), Ok(a)) => Ok(a),
                (Err(a), Err(b)) => Err(a.min(b)),
            };
        }
        Ok(best)
    }

    /// The plan of `point` with the shortest prefix of `pairs` offloaded that fits `budget`;
    /// else the peak with the longest prefix the host memory takes offloaded (the point's own
    /// if none).
    fn prefix_within(
        &self,
        point: &Point,
        pairs: &[(LayerRef, Moved)],
        budget: u64,
    ) -> Result<Result<Plan, u64>, BudgetError> {
        if pairs.is_empty() {
            return Ok(Err(point.figures.peak_bytes));
        }
        let plan_with = |k: usize| self.plan_offloading(&point.choice, &pairs[..k]);
        let (most, top) = self.longest_accepted_prefix(pairs.len(), &plan_with)?;
        if most == 0 || !fits(&top, budget) {
            return Ok(Err(match most {
                0 => point.figures.peak_bytes,
                _ => top.memory.peak_bytes.unwrap_or(0),
            }));
        }
        // None offloaded is the point itself, above the budget.
        let fitting = bisect((0, (most, top)), &plan_with, |plan| fits(plan, budget))?;
        Ok(Ok(fitting.1 .1))
    }

    /// The longest prefix of `pairs` pairs whose plan `plan` accepts, and that plan: all of
    /// them, unless the offloaded values overflow the profile's host memory (an error), which
    /// only a longer prefix can do, so a binary search finds the longest that does not.
    fn longest_accepted_prefix(
        &self,
        pairs: usize,
        plan_with: &dyn Fn(usize) -> Result<Plan, BudgetError>,
    ) -> Result<(usize, Plan), BudgetError> {
        let all = plan_with(pairs)?;
        if !all.has_errors() {
            return Ok((pairs, all));
        }
        // None offloaded is the frontier point itself, which `plan` accepts. With no prefix
        // accepted the length is 0, and the plan returned (rejected) is not read.
        let (accepted, (_, rejected)) = bisect((0, (pairs, all)), plan_with, Plan::has_errors)?;
        Ok(match accepted {
            (lo, Some(plan)) => (lo, plan),
            (_, None) => (0, rejected),
        })
    }

    /// `pareto --with-offload`: each point of the frontier of density `steps` with a quarter,
    /// half, three quarters and all of its (layer, unit or layer input) pairs offloaded, in
    /// [`Search::pairs_of`]'s order (the first that [`Search::within_offloading`] tries), as
    /// full plans; those `plan` rejects dropped.
    pub fn offloaded_points(&self, steps: u64) -> Result<Vec<Plan>, BudgetError> {
        let jobs: Vec<(Vec<u8>, Pairs)> = self
            .frontier(steps)?
            .into_iter()
            .flat_map(|point| {
                let pairs = self.pairs_of(&point);
                let mut prefixes: Vec<usize> =
                    (1..=4).map(|q| (pairs.len() * q).div_ceil(4)).collect();
                prefixes.dedup();
                prefixes
                    .into_iter()
                    .filter(|&k| k > 0)
                    .map(move |k| (point.choice.clone(), pairs[..k].to_vec()))
                    .collect::<Vec<_>>()
            })
            .collect();
        self.stage("offload", Some(jobs.len() as u64));
        let plans: Vec<Plan> = jobs
            .par_iter()
            .map(|(choice, offloaded)| self.plan_offloading(choice, offloaded))
            .collect::<Result<_, _>>()?;
        Ok(plans.into_iter().filter(|p| !p.has_errors()).collect())
    }

    /// The orders a point's pairs are offloaded in: [`Search::pairs_of`]'s, then every kept
    /// unit's pairs before the layer inputs, then the layer inputs first (each part in layer
    /// order). One order of prefixes misses subsets another reaches: a layer's inputs alone
    /// may fit the budget with less to copy than the units of the layers before it.
    fn orders_of(&self, point: &Point) -> Vec<Pairs> {
        let interleaved = self.pairs_of(point);
        let is_unit = |p: &&(LayerRef, Moved)| matches!(p.1, Moved::Unit(_));
        let units = interleaved.iter().filter(is_unit);
        let inputs = interleaved.iter().filter(|p| !is_unit(p));
        let units_first: Pairs = units.clone().chain(inputs.clone()).copied().collect();
        let inputs_first: Pairs = inputs.chain(units).copied().collect();
        // A point that keeps nothing has one order, one of a single layer two (adjacent
        // duplicates): each is searched once.
        let mut orders = vec![interleaved, units_first, inputs_first];
        orders.dedup();
        orders
    }

    /// A point's (layer, unit) pairs and each layer's inputs, in layer order (in a layer, its
    /// kept units, then its layer inputs).
    fn pairs_of(&self, point: &Point) -> Pairs {
        self.layers
            .at
            .iter()
            .zip(&point.choice)
            .flat_map(|(&at, &o)| {
                let units = subset(usize::from(o)).into_iter().map(Moved::Unit);
                units
                    .chain(std::iter::once(Moved::LayerInput))
                    .map(move |m| (at, m))
            })
            .collect()
    }

    /// The plan keeping, in each searched layer, the units of its option, with the saved
    /// values of `offloaded` (layer, unit) pairs on the host.
    fn plan_offloading(
        &self,
        choice: &[u8],
        offloaded: &[(LayerRef, Moved)],
    ) -> Result<Plan, BudgetError> {
        let mut layer_offload: BTreeMap<LayerRef, Vec<UnitId>> = BTreeMap::new();
        let mut inputs = BTreeSet::new();
        for &(at, moved) in offloaded {
            match moved {
                Moved::Unit(unit) => layer_offload.entry(at).or_default().push(unit),
                Moved::LayerInput => {
                    inputs.insert(at);
                }
            }
        }
        self.plan_resolved(
            self.resolved_of(choice)
                .with_layer_offload(layer_offload, inputs),
        )
    }

    fn check_floor(&self, budget: u64) -> Result<(), BudgetError> {
        let floor = self.floor()?;
        if budget < floor {
            return Err(BudgetError::Infeasible {
                budget,
                smallest: floor,
            });
        }
        Ok(())
    }

    /// Each `--keep` of a non-empty set of unit names, as a per-layer choice: a layer keeps
    /// those of its model's units the set names. None when the graph declares more than
    /// [`MAX_UNITS`] distinct names (2^names choices).
    fn uniform_choices(&self) -> Vec<Vec<u8>> {
        let names = config::declared_units(self.graph);
        if names.len() > MAX_UNITS {
            return Vec::new();
        }
        (1..1usize << names.len())
            .map(|set| {
                let keep = Keep::Units(
                    (0..names.len())
                        .filter(|i| set >> i & 1 == 1)
                        .map(|i| names[i].clone())
                        .collect(),
                );
                self.layers
                    .at
                    .iter()
                    .map(|at| {
                        let kept = config::kept_units_of(self.graph.model(at.model), &keep);
                        kept.iter().fold(0u8, |o, &u| o | 1 << u.index())
                    })
                    .collect()
            })
            .collect()
    }
}

impl Point {
    /// At least as good on both axes and better on one.
    pub fn dominates(&self, other: &Point) -> bool {
        let (a, b) = (&self.figures, &other.figures);
        a.peak_bytes <= b.peak_bytes
            && a.replay_time_s <= b.replay_time_s
            && (a.peak_bytes < b.peak_bytes || a.replay_time_s < b.replay_time_s)
    }
}

/// A plan's frontier figures.
fn figures_of(plan: &Plan) -> Figures {
    Figures {
        peak_bytes: plan.memory.peak_bytes.unwrap_or(0),
        replay_time_s: plan.cost.replay_time_s,
        saved_bytes: plan.memory.saved_bytes,
    }
}

/// Checkpointed layers of models with units, in order.
fn searched_layers(graph: &Graph, resolved: &Resolved) -> Vec<LayerRef> {
    let mut at: Vec<LayerRef> = graph
        .nodes()
        .values()
        .filter(|n| {
            n.phase == Phase::Forward
                && resolved.is_checkpointed(n.model, n.layer)
                && !graph.model(n.model).units.is_empty()
        })
        .filter_map(|n| {
            Some(LayerRef {
                model: n.model,
                layer: n.layer?,
            })
        })
        .collect();
    at.sort_unstable();
    at.dedup();
    at
}

/// The runs to plan: every unit subset of each model with searched layers.
fn runs_of(graph: &Graph, layers: &Layers) -> Result<Vec<(ModelId, usize)>, BudgetError> {
    let mut models: Vec<ModelId> = layers.at.iter().map(|at| at.model).collect();
    models.dedup();
    let mut jobs = Vec::new();
    for model in models {
        let units = graph.model(model).units.len();
        if units > MAX_UNITS {
            return Err(BudgetError::TooManyUnits {
                model: graph.model(model).name.clone(),
                units,
            });
        }
        jobs.extend((0..1usize << units).map(|o| (model, o)));
    }
    Ok(jobs)
}

/// Plans `graph` with option `option` in every searched layer of `model` (policy and
/// partition; what a candidate needs, so no verification) and reads the run off it.
fn run(
    graph: &Graph,
    base: &PlanConfig,
    resolved: &Resolved,
    layers: &Layers,
    (model, option): (ModelId, usize),
    work: &NodeWork,
) -> Run {
    let layer_units = layers
        .at
        .iter()
        .filter(|at| at.model == model)
        .map(|&at| (at, subset(option)))
        .collect();
    let resolved = resolved.clone().with_layer_units(layer_units);
    let policy = policy::apply(graph, base, &resolved);
    let partition = partition::partition(graph, &policy, base.executor);
    Run::new(
        graph,
        layers,
        (model, option),
        &policy,
        partition,
        work,
        base.executor,
    )
}

impl Search<'_> {
    /// `--granularity op`: refines the unit-level answer for `budget` by also keeping single
    /// replayed ops, best replay-seconds-per-byte first.
    ///
    /// Candidates are the ops the unit-level plan replays that can be kept (eager, not
    /// mutable, not a view, marker or collective, output never written in place), ranked by
    /// their own replay time over their output bytes. The longest prefix of that ranking whose
    /// exact simulated peak fits is found by binary search (about log2(candidates) plans).
    /// Optimality gap: greedy by ratio is the fractional-knapsack optimum up to the last item,
    /// but an op's own replay time is only an estimate of what keeping it saves (its inputs may
    /// still replay for other consumers, or stop replaying too), and the binary search assumes
    /// the peak grows with the prefix.
    pub fn within_ops(&self, budget: u64) -> Result<Plan, BudgetError> {
        let units = self.within(budget)?;
        let layer_units: BTreeMap<LayerRef, Vec<UnitId>> = units
            .config
            .layer_keep
            .iter()
            .map(|l| (l.at, l.units.clone()))
            .collect();
        let mut ranked: Vec<(f64, NodeId)> = units
            .replay
            .iter()
            .flat_map(|r| r.nodes.iter().copied())
            .filter(|&id| self.keepable(id))
            .map(|id| {
                let bytes = self
                    .graph
                    .node(id)
                    .outputs
                    .iter()
                    .map(|&v| self.graph.value(v).bytes)
                    .sum::<u64>();
                (self.work.node(id).seconds / bytes.max(1) as f64, id)
            })
            .collect();
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let plan_with = |k: usize| -> Result<Plan, BudgetError> {
            let chosen = ranked[..k].iter().map(|&(_, id)| id).collect();
            self.plan_resolved(
                self.resolved
                    .clone()
                    .with_layer_units(layer_units.clone())
                    .with_chosen_ops(chosen),
            )
        };
        let fits = |p: &Plan| fits(p, budget);
        let (mut lo, mut hi) = (0usize, ranked.len());
        let mut best = units;
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            let plan = plan_with(mid)?;
            if fits(&plan) {
                if is_better(&plan, Some(&best)) {
                    best = plan;
                }
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Ok(best)
    }

    /// Whether the policy can keep `id` on its own.
    fn keepable(&self, id: NodeId) -> bool {
        let node = self.graph.node(id);
        node.compiled_region.is_none()
            && node.marker().is_none()
            && !node.effects.is_mutable()
            && node.effects.view_of.is_none()
            && node.effects.collective.is_none()
            && !node.is_device_to_host_copy()
            && node
                .outputs
                .iter()
                .all(|&v| self.graph.storage_writers(v).is_empty())
    }
}

ir::spelled! {
    /// How finely `--budget` chooses what each checkpointed layer keeps.
    #[derive(Default)]
    pub enum Granularity {
        /// Whole units (a subset of the model's units per layer).
        #[default]
        Unit => "unit",
        /// Units, then single ops of the layers where that saves replay time.
        Op => "op",
    }
}

impl Search<'_> {
    /// The answer to `--budget budget` at `granularity`, with kept units' saved values also
    /// offloaded where that is faster when `offload` (`--budget-offload`), its configuration
    /// stating the budget: what `planner plan --budget` and the Python `plan(budget=...)`
    /// return.
    pub fn answer(
        &self,
        budget: u64,
        granularity: Granularity,
        offload: bool,
    ) -> Result<Plan, BudgetError> {
        let mut plan = match (granularity, offload) {
            (Granularity::Unit, false) => self.within(budget),
            (Granularity::Unit, true) => self.within_offloading(budget),
            (Granularity::Op, false) => self.within_ops(budget),
            (Granularity::Op, true) => Err(BudgetError::OffloadOps),
        }?;
        plan.config.budget_bytes = Some(budget);
        Ok(plan)
    }
}

/// Plans `graph` under `config`, choosing per-layer units to fit `budget` bytes.
pub fn plan_within(
    graph: &Graph,
    config: &PlanConfig,
    hw: &HwProfile,
    budget: u64,
) -> Result<Plan, BudgetError> {
    Search::new(graph, config, hw)?.within(budget)
}

/// The units of option bitmask `o`.
fn subset(o: usize) -> Vec<UnitId> {
    (0..usize::BITS as usize)
        .filter(|i| o >> i & 1 == 1)
        .map(UnitId::from_index)
        .collect()
}

/// The boundary of a property of prefix plans that holds from some length on: given a length
/// `lo` known not to hold it and `(hi, its plan)` known to, the longest length below the boundary
/// (with its plan, if one was made) and the shortest at or above it (with its plan), found by
/// binary search in about `log2(hi - lo)` plans.
#[allow(clippy::type_complexity)] // the two sides of the boundary, each with what is known
fn bisect(
    (mut lo, (mut hi, mut hi_plan)): (usize, (usize, Plan)),
    plan_with: &dyn Fn(usize) -> Result<Plan, BudgetError>,
    holds: impl Fn(&Plan) -> bool,
) -> Result<((usize, Option<Plan>), (usize, Plan)), BudgetError> {
    let mut lo_plan = None;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let plan = plan_with(mid)?;
        if holds(&plan) {
            (hi, hi_plan) = (mid, plan);
        } else {
            (lo, lo_plan) = (mid, Some(plan));
        }
    }
    Ok(((lo, lo_plan), (hi, hi_plan)))
}

/// What a layer may move to host memory as one: the saved values of one kept unit, or its layer
/// inputs (its output, which the next checkpointed layer saves as its input).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Moved {
    Unit(UnitId),
    LayerInput,
}

/// (layer, what it moves) pairs, each offloaded or not as one.
type Pairs = Vec<(LayerRef, Moved)>;

/// What a budget answer with offload minimises: replay time plus the transfer time compute
/// does not hide.
fn step_cost(plan: &Plan) -> f64 {
    plan.cost.replay_time_s + plan.cost.exposed_transfer_time_s
}

/// Less replay time, or as much with a lower peak.
fn is_better(plan: &Plan, best: Option<&Plan>) -> bool {
    best.is_none_or(|b| {
        let (t, bt) = (plan.cost.replay_time_s, b.cost.replay_time_s);
        t < bt || (t == bt && plan.memory.peak_bytes < b.memory.peak_bytes)
    })
}
