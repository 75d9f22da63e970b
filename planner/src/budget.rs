//! `--budget SIZE`: per checkpointed layer, the set of units that minimises predicted
//! replay time with the predicted peak within the budget.
//!
//! Method:
//! 1. Options are exact: every subset of the model's declared units. Each subset is evaluated
//!    once per model (applied to all its checkpointed layers in one plan), and its effect is
//!    read per layer: saved activation bytes `m(l, o)` and replay seconds `t(l, o)`. Identical
//!    layers (same forward op, marker and region sequence) share the representative's figures,
//!    so each distinct layer is solved once.
//! 2. Small searches are exact: with at most [`EXHAUSTIVE_LIMIT`] per-layer combinations every
//!    one is planned and simulated, and the fastest that fits wins.
//! 3. Larger ones: a multiple-choice knapsack over the linear peak model
//!    `peak ≈ peak(nothing kept) + Σ_l (m(l, o_l) − m(l, ∅))`, solved exactly by dynamic
//!    programming over the headroom `budget − peak(∅)` quantised into [`BUCKETS`] steps (costs
//!    rounded up). Each answer is simulated exactly: keeping everything that helps is tried
//!    first; an answer over budget shrinks the headroom by the excess, one with slack grows it
//!    (at most [`MAX_ROUNDS`] times); every uniform choice (`--keep` of a set of unit names,
//!    the same in every layer) is simulated too; then a first-improvement local search over
//!    single-layer changes, each simulated exactly, refines the best feasible answer (at most
//!    [`MAX_REFINE_PLANS`] plans). The answer always fits (keeping nothing is the fallback) and,
//!    when the graph declares at most [`MAX_UNITS`] unit names, is never slower than the best
//!    uniform `--keep` that fits.
//!
//! Optimality gap of step 3: the linear model overestimates the peak when keeping shrinks a
//! replay's transient (it does in the last layers), which the slack rounds and the local search
//! recover; the option tables come from one representative layer per class, so they can miss a
//! unit that helps another layer a little, which the uniform seeds catch. On the three-layer
//! test graph of `tests/budget.rs`, over 17 budgets, the knapsack alone was up to 61% slower
//! than the optimum found by brute force, and with the local search 0%. On the MoE golden
//! deepened to 10 layers (16^10 combinations, no brute force), over 9 budgets, the answer's
//! replay time was 0% to 14.1% below the best uniform `--keep` that fits (0% to 10.9% on the
//! GLM/DSA golden, main and MTP models); before the uniform seeds it was up to 29% above at one
//! budget. The local search stops at a local optimum, so
//! the gap is not bounded in general.

use std::collections::BTreeMap;

use ir::{
    plan::{Keep, LayerRef, Plan, SavedKind},
    EntityId, Graph, ModelId, NodeId, Phase, UnitId,
};
use rayon::prelude::*;

use crate::{
    config::{self, PlanConfig, Resolved},
    cost::HwProfile,
    partition,
    plan::{self, Baselines, PlanError},
    progress::{Progress, Silent},
};

/// Quantisation of the headroom for the knapsack.
pub const BUCKETS: u64 = 4096;
/// Plans the heuristic's local search may simulate.
pub const MAX_REFINE_PLANS: usize = 256;
/// Up to this many per-layer combinations, every one is simulated: the answer is exact.
pub const EXHAUSTIVE_LIMIT: u64 = 1024;
/// Re-solves allowed when the exact simulation disagrees with the linear peak model.
pub const MAX_ROUNDS: usize = 8;
/// Models with more units than this are not searched exhaustively (2^units plans each).
pub const MAX_UNITS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("budget {budget} B is below the smallest achievable peak, {smallest} B (whole-layer recompute of the checkpointed layers); raise the budget or --recompute-ratio")]
    Infeasible { budget: u64, smallest: u64 },
    #[error("--budget needs a joint forward+backward graph (this one has no backward nodes)")]
    NotJoint,
    #[error(
        "model `{model}` declares {units} units; the exact search handles at most {MAX_UNITS}"
    )]
    TooManyUnits { model: String, units: usize },
}

/// One checkpointed layer's figures under one option.
#[derive(Debug, Clone, Copy)]
struct Figures {
    saved_bytes: u64,
    replay_s: f64,
    /// False when planning the option is rejected (an error diagnostic): never chosen.
    allowed: bool,
}

impl Default for Figures {
    fn default() -> Self {
        Figures {
            saved_bytes: 0,
            replay_s: 0.0,
            allowed: true,
        }
    }
}

/// A candidate answer for `budget`: its peak fits and `plan` accepts it (no error).
fn fits(plan: &Plan, budget: u64) -> bool {
    plan.memory.peak_bytes.unwrap_or(0) <= budget && !plan.has_errors()
}

/// A layer to decide and the option table of its class.
struct Slot {
    at: LayerRef,
    class: usize,
}

/// Everything the solver needs: the keep-nothing floor and each layer class's option table.
pub struct Search<'g> {
    graph: &'g Graph,
    base: PlanConfig,
    hw: &'g HwProfile,
    resolved: Resolved,
    /// Computed once: every candidate plan shares them.
    baselines: Baselines,
    /// The plan keeping nothing: the smallest peak.
    pub nothing: Plan,
    slots: Vec<Slot>,
    options: Vec<Vec<Figures>>,
    progress: &'g dyn Progress,
}

impl<'g> Search<'g> {
    /// Evaluates every unit subset of every model once (2^units plans per model).
    pub fn new(
        graph: &'g Graph,
        config: &PlanConfig,
        hw: &'g HwProfile,
    ) -> Result<Self, BudgetError> {
        Search::with_progress(graph, config, hw, &Silent)
    }

    /// [`Search::new`], reporting each candidate plan to `progress`.
    pub fn with_progress(
        graph: &'g Graph,
        config: &PlanConfig,
        hw: &'g HwProfile,
        progress: &'g dyn Progress,
    ) -> Result<Self, BudgetError> {
        let base = PlanConfig {
            keep: Keep::Nothing,
            ..config.clone()
        };
        let resolved = config::resolve(graph, &base).map_err(PlanError::from)?;
        if !partition::is_joint(graph) {
            return Err(BudgetError::NotJoint);
        }
        let baselines = Baselines::of(graph, config.executor)?;
        let nothing = plan::plan_against(graph, &base, resolved.clone(), hw, &baselines)?;
        let (slots, classes) = layer_classes(graph, &resolved);
        let tables: u64 = distinct_models(&slots)
            .iter()
            .map(|&m| 1u64 << graph.model(m).units.len().min(MAX_UNITS + 1))
            .sum();
        progress.stage("option tables", Some(tables));
        let plan = |resolved| {
            progress.advance();
            plan::plan_against(graph, &base, resolved, hw, &baselines)
        };
        let options = evaluate_options(graph, plan, &resolved, &slots, classes)?;
        Ok(Search {
            graph,
            base,
            hw,
            resolved,
            baselines,
            nothing,
            slots,
            options,
            progress,
        })
    }

    /// Reports the start of a search stage.
    pub fn stage(&self, what: &str, total: Option<u64>) {
        self.progress.stage(what, total);
    }

    /// Distinct layer classes (identical layers share one).
    pub fn classes(&self) -> usize {
        self.options.len()
    }

    /// The smallest achievable peak (keep nothing).
    pub fn floor(&self) -> u64 {
        self.nothing.memory.peak_bytes.unwrap_or(0)
    }

    /// The most extra bytes any choice can keep, by the linear model.
    pub fn max_headroom(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| {
                let table = &self.options[s.class];
                table
                    .iter()
                    .filter(|f| f.allowed)
                    .map(|f| f.saved_bytes.saturating_sub(table[0].saved_bytes))
                    .max()
                    .unwrap_or(0)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// What `keep` makes of the plans of the knapsack's choices for `steps + 1` evenly spaced
    /// headrooms from 0 to the largest useful one, from one solved knapsack; repeated choices
    /// are planned once, and each plan is dropped as soon as `keep` has seen it.
    pub fn sweep<T: Send>(
        &self,
        steps: u64,
        keep: impl Fn(Plan) -> T + Sync,
    ) -> Result<Vec<T>, BudgetError> {
        let max = self.max_headroom();
        let table = Knapsack::solve(&self.slots, &self.options, max);
        let mut choices: Vec<Vec<usize>> = (0..=steps.max(1))
            .map(|k| {
                let headroom = u128::from(max) * u128::from(k) / u128::from(steps.max(1));
                table.choice(u64::try_from(headroom).unwrap_or(max))
            })
            .collect();
        choices.dedup();
        choices
            .par_iter()
            .map(|c| self.plan_of(c).map(&keep))
            .collect()
    }

    /// The plan keeping, in each slot's layer, the units of its option.
    fn plan_of(&self, choice: &[usize]) -> Result<Plan, BudgetError> {
        let layer_units = self
            .slots
            .iter()
            .zip(choice)
            .map(|(s, &o)| (s.at, subset(o)))
            .collect();
        self.plan_resolved(self.resolved.clone().with_layer_units(layer_units))
    }

    fn plan_resolved(&self, resolved: Resolved) -> Result<Plan, BudgetError> {
        self.progress.advance();
        let plan = plan::plan_against(self.graph, &self.base, resolved, self.hw, &self.baselines);
        Ok(plan?)
    }

    /// The plan with the least predicted replay time whose simulated peak fits `budget`:
    /// exhaustive when there are at most [`EXHAUSTIVE_LIMIT`] per-layer combinations, else
    /// [`Search::heuristic_within`].
    pub fn within(&self, budget: u64) -> Result<Plan, BudgetError> {
        if self.combinations() <= EXHAUSTIVE_LIMIT {
            self.stage("every combination", Some(self.combinations()));
            self.exhaustive_within(budget)
        } else {
            self.stage("knapsack and local search", None);
            self.heuristic_within(budget)
        }
    }

    /// Per-layer option combinations: the product of the option counts.
    pub fn combinations(&self) -> u64 {
        self.slots.iter().fold(1u64, |acc, s| {
            acc.saturating_mul(self.options[s.class].len() as u64)
        })
    }

    /// Simulates every combination and takes the fastest that fits: exact.
    pub fn exhaustive_within(&self, budget: u64) -> Result<Plan, BudgetError> {
        self.check_floor(budget)?;
        let mut best: Option<Plan> = None;
        for plan in self.every_combination() {
            let plan = plan?;
            if fits(&plan, budget) && is_better(&plan, best.as_ref()) {
                best = Some(plan);
            }
        }
        Ok(best.unwrap_or_else(|| self.nothing.clone()))
    }

    /// The plan of every per-layer combination, in mixed-radix order.
    pub fn every_combination(&self) -> impl Iterator<Item = Result<Plan, BudgetError>> + '_ {
        let radix: Vec<usize> = self
            .slots
            .iter()
            .map(|s| self.options[s.class].len())
            .collect();
        let total = radix.iter().product::<usize>();
        (0..total).map(move |mut k| {
            let choice: Vec<usize> = radix
                .iter()
                .map(|&r| {
                    let o = k % r;
                    k /= r;
                    o
                })
                .collect();
            self.plan_of(&choice)
        })
    }

    fn check_floor(&self, budget: u64) -> Result<(), BudgetError> {
        let floor = self.floor();
        if budget < floor {
            return Err(BudgetError::Infeasible {
                budget,
                smallest: floor,
            });
        }
        Ok(())
    }

    /// The knapsack over the linear peak model, corrected by exact simulation, seeded with
    /// every uniform choice, then refined by local search.
    ///
    /// The linear peak model is conservative when the peak sits elsewhere (at the end of
    /// backward, say), so a feasible answer with slack is retried with the slack added to the
    /// headroom, and an infeasible one with the excess removed. The option tables come from
    /// one representative layer per class, so "every unit that helps" can miss a unit that
    /// helps another layer a little: the uniform choices (the same units in every layer, what
    /// a user picks by hand with `--keep`) are tried too, and the answer is never worse than
    /// the best of them that fits.
    pub fn heuristic_within(&self, budget: u64) -> Result<Plan, BudgetError> {
        self.check_floor(budget)?;
        let mut best = Best {
            budget,
            choice: vec![0; self.slots.len()],
            plan: self.nothing.clone(),
        };
        let max_headroom = self.max_headroom();
        let all = knapsack(&self.slots, &self.options, max_headroom);
        let everything = self.plan_of(&all)?;
        if !best.offer(all, everything) {
            let mut headroom = (budget - self.floor()).min(max_headroom);
            for _ in 0..MAX_ROUNDS {
                let choice = knapsack(&self.slots, &self.options, headroom);
                let plan = self.plan_of(&choice)?;
                let peak = plan.memory.peak_bytes.unwrap_or(0);
                let next = if best.offer(choice, plan) {
                    headroom.saturating_add(budget - peak).min(max_headroom)
                } else {
                    headroom.saturating_sub(peak - budget)
                };
                if next == headroom {
                    break;
                }
                headroom = next;
            }
        }
        for (choice, plan) in self.uniform_candidates() {
            best.offer(choice, plan?);
        }
        self.refine(best)
    }

    /// Each uniform choice (the same unit names in every layer, as `--keep` would), planned.
    pub fn uniform_plans(&self) -> Vec<Result<Plan, BudgetError>> {
        self.uniform_candidates()
            .into_iter()
            .map(|(_, plan)| plan)
            .collect()
    }

    /// Each uniform choice and its plan, planned in parallel.
    fn uniform_candidates(&self) -> Vec<(Vec<usize>, Result<Plan, BudgetError>)> {
        let choices: Vec<Vec<usize>> = self.uniform_choices().collect();
        let plans: Vec<_> = choices.par_iter().map(|c| self.plan_of(c)).collect();
        choices.into_iter().zip(plans).collect()
    }

    /// Each `--keep` of a non-empty set of unit names, as a per-layer choice: a layer keeps
    /// those of its model's units the set names. None when the graph declares more than
    /// [`MAX_UNITS`] distinct names (2^names plans).
    fn uniform_choices(&self) -> impl Iterator<Item = Vec<usize>> + '_ {
        let names = config::declared_units(self.graph);
        let sets = if names.len() <= MAX_UNITS {
            1..1usize << names.len()
        } else {
            0..0
        };
        sets.map(move |set| {
            let keep = Keep::Units(
                (0..names.len())
                    .filter(|i| set >> i & 1 == 1)
                    .map(|i| names[i].clone())
                    .collect(),
            );
            self.slots
                .iter()
                .map(|s| {
                    let kept = config::kept_units_of(self.graph.model(s.at.model), &keep);
                    kept.iter().fold(0, |o, &u| o | 1 << u.index())
                })
                .collect()
        })
    }

    /// First-improvement local search with exact simulation: try single-layer option changes
    /// by decreasing predicted gain, take the first that fits and is faster, repeat; at most
    /// [`MAX_REFINE_PLANS`] plans.
    fn refine(&self, start: Best) -> Result<Plan, BudgetError> {
        let Best {
            budget,
            mut choice,
            mut plan,
        } = start;
        let mut tries = 0;
        'improve: loop {
            let mut moves: Vec<(f64, usize, usize)> = Vec::new();
            for (i, slot) in self.slots.iter().enumerate() {
                let table = &self.options[slot.class];
                let now = table[choice[i]].replay_s;
                for (o, f) in table.iter().enumerate() {
                    if f.allowed && f.replay_s < now {
                        moves.push((now - f.replay_s, i, o));
                    }
                }
            }
            moves.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
            let candidates: Vec<Vec<usize>> = moves
                .iter()
                .map(|&(_, i, o)| {
                    let mut candidate = choice.clone();
                    candidate[i] = o;
                    candidate
                })
                .collect();
            // A batch per core is planned at once; the earliest improvement in move order
            // wins and counts the tries a one-by-one scan would have made, so the answer does
            // not depend on the number of cores.
            for batch in candidates.chunks(rayon::current_num_threads().max(1)) {
                let batch = &batch[..batch.len().min(MAX_REFINE_PLANS - tries)];
                if batch.is_empty() {
                    break 'improve;
                }
                let plans: Vec<_> = batch.par_iter().map(|c| self.plan_of(c)).collect();
                for (k, (candidate, next)) in batch.iter().zip(plans).enumerate() {
                    let next = next?;
                    if fits(&next, budget) && is_better(&next, Some(&plan)) {
                        tries += k + 1;
                        (choice, plan) = (candidate.clone(), next);
                        continue 'improve;
                    }
                }
                tries += batch.len();
            }
            break;
        }
        Ok(plan)
    }
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
                (
                    self.hw.node_seconds(self.graph, id) / bytes.max(1) as f64,
                    id,
                )
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
            && node.marker.is_none()
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

/// The best choice found so far for a budget.
struct Best {
    budget: u64,
    choice: Vec<usize>,
    plan: Plan,
}

impl Best {
    /// Takes `plan` if it fits and is better; says whether it fits.
    fn offer(&mut self, choice: Vec<usize>, plan: Plan) -> bool {
        let fits = fits(&plan, self.budget);
        if fits && is_better(&plan, Some(&self.plan)) {
            (self.choice, self.plan) = (choice, plan);
        }
        fits
    }
}

/// Less replay time, or as much with a lower peak.
fn is_better(plan: &Plan, best: Option<&Plan>) -> bool {
    best.is_none_or(|b| {
        let (t, bt) = (plan.cost.replay_time_s, b.cost.replay_time_s);
        t < bt || (t == bt && plan.memory.peak_bytes < b.memory.peak_bytes)
    })
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

/// Checkpointed layers of models with units, and for each its class: layers with the same
/// forward op, marker and compiled-region sequence behave alike.
fn layer_classes(graph: &Graph, resolved: &Resolved) -> (Vec<Slot>, usize) {
    // Per forward node: op, marker, compiled or not, micro-batch.
    type Step<'g> = (&'g str, Option<&'g str>, bool, u32);
    let mut signatures: BTreeMap<LayerRef, Vec<Step>> = BTreeMap::new();
    for node in graph.nodes().values() {
        let Some(layer) = node.layer else { continue };
        if node.phase != Phase::Forward
            || !resolved.is_checkpointed(node.model, Some(layer))
            || graph.model(node.model).units.is_empty()
        {
            continue;
        }
        let at = LayerRef {
            model: node.model,
            layer,
        };
        signatures.entry(at).or_default().push((
            node.op.as_str(),
            node.marker.as_deref(),
            node.compiled_region.is_some(),
            node.micro_batch,
        ));
    }
    // Identical layers share a class: one hash lookup per layer, not a scan of the classes.
    let mut classes: rustc_hash::FxHashMap<(ModelId, &Vec<Step>), usize> =
        rustc_hash::FxHashMap::default();
    let mut slots = Vec::with_capacity(signatures.len());
    for (&at, signature) in &signatures {
        let next = classes.len();
        let class = *classes.entry((at.model, signature)).or_insert(next);
        slots.push(Slot { at, class });
    }
    (slots, classes.len())
}

/// The models that own the slots, each once, in slot order.
fn distinct_models(slots: &[Slot]) -> Vec<ModelId> {
    let mut models: Vec<ModelId> = slots.iter().map(|s| s.at.model).collect();
    models.dedup();
    models
}

/// `options[class][o]`: the figures of the class's representative layer under subset `o`.
/// The option tables: `plan` plans the graph under per-layer choices.
fn evaluate_options(
    graph: &Graph,
    plan: impl Fn(Resolved) -> Result<Plan, PlanError> + Sync,
    resolved: &Resolved,
    slots: &[Slot],
    classes: usize,
) -> Result<Vec<Vec<Figures>>, BudgetError> {
    let mut options: Vec<Vec<Figures>> = vec![Vec::new(); classes];
    for model in distinct_models(slots) {
        let units = graph.model(model).units.len();
        if units > MAX_UNITS {
            return Err(BudgetError::TooManyUnits {
                model: graph.model(model).name.clone(),
                units,
            });
        }
        let representatives: BTreeMap<usize, LayerRef> = slots
            .iter()
            .filter(|s| s.at.model == model)
            .map(|s| (s.class, s.at))
            .rev()
            .collect();
        let plans: Vec<_> = (0..1usize << units)
            .into_par_iter()
            .map(|o| {
                let layer_units = slots
                    .iter()
                    .filter(|s| s.at.model == model)
                    .map(|s| (s.at, subset(o)))
                    .collect();
                plan(resolved.clone().with_layer_units(layer_units))
            })
            .collect();
        for plan in plans {
            let plan = plan?;
            let allowed = !plan.has_errors();
            let figures = figures_by_layer(&plan);
            for (&class, at) in &representatives {
                let f = figures.get(at).copied().unwrap_or_default();
                options[class].push(Figures { allowed, ..f });
            }
        }
    }
    Ok(options)
}

/// Each layer's figures under one plan, in one pass over its saved values and replays.
fn figures_by_layer(plan: &Plan) -> rustc_hash::FxHashMap<LayerRef, Figures> {
    let mut figures: rustc_hash::FxHashMap<LayerRef, Figures> = rustc_hash::FxHashMap::default();
    for s in &plan.saved {
        let (Some(model), Some(layer)) = (s.model, s.layer) else {
            continue;
        };
        // An alias adds no storage of its own.
        if matches!(s.kind, SavedKind::Kept | SavedKind::WritesResident) && s.alias_of.is_none() {
            let f = figures.entry(LayerRef { model, layer }).or_default();
            f.saved_bytes = f.saved_bytes.saturating_add(s.bytes);
        }
    }
    for r in &plan.replay {
        figures.entry(r.at).or_default().replay_s += r.seconds;
    }
    figures
}

/// Exact multiple-choice knapsack over quantised headroom: per slot the option index.
fn knapsack(slots: &[Slot], options: &[Vec<Figures>], headroom: u64) -> Vec<usize> {
    Knapsack::solve(slots, options, headroom).choice(headroom)
}

/// The solved knapsack for every headroom up to `max`, quantised in steps of `max / BUCKETS`:
/// one dynamic program answers a whole sweep of headrooms.
struct Knapsack<'a> {
    slots: &'a [Slot],
    options: &'a [Vec<Figures>],
    quantum: u64,
    /// Per slot and capacity in quanta, the option of the best choice using at most that many
    /// quanta; one byte each (options are unit subsets of at most MAX_UNITS units).
    picks: Vec<Vec<u8>>,
}

impl<'a> Knapsack<'a> {
    fn solve(slots: &'a [Slot], options: &'a [Vec<Figures>], max: u64) -> Self {
        let quantum = max.div_ceil(BUCKETS).max(1);
        let capacity = (max / quantum) as usize;
        // best[c] = least replay seconds using at most c quanta.
        let mut best = vec![0.0f64; capacity + 1];
        let mut picks: Vec<Vec<u8>> = Vec::with_capacity(slots.len());
        for slot in slots {
            let table = &options[slot.class];
            let costs: Vec<usize> = table
                .iter()
                .map(|f| quanta(f, &table[0], quantum))
                .collect();
            let mut next = vec![f64::INFINITY; capacity + 1];
            let mut pick = vec![0u8; capacity + 1];
            for c in 0..=capacity {
                for (o, (f, &k)) in table.iter().zip(&costs).enumerate() {
                    if f.allowed && k <= c && best[c - k] + f.replay_s < next[c] {
                        next[c] = best[c - k] + f.replay_s;
                        pick[c] = o as u8;
                    }
                }
            }
            best = next;
            picks.push(pick);
        }
        Knapsack {
            slots,
            options,
            quantum,
            picks,
        }
    }

    /// The best choice with at most `headroom` extra bytes (at most the `max` solved for).
    fn choice(&self, headroom: u64) -> Vec<usize> {
        let capacity = self.picks.first().map_or(0, |p| p.len() - 1);
        let mut c = ((headroom / self.quantum) as usize).min(capacity);
        let mut choice = vec![0; self.slots.len()];
        for (i, slot) in self.slots.iter().enumerate().rev() {
            let o = usize::from(self.picks[i][c]);
            choice[i] = o;
            let table = &self.options[slot.class];
            c -= quanta(&table[o], &table[0], self.quantum);
        }
        choice
    }
}

/// The quanta option `f` costs over keeping nothing (`base`), rounded up.
fn quanta(f: &Figures, base: &Figures, quantum: u64) -> usize {
    let extra = f.saved_bytes.saturating_sub(base.saved_bytes);
    usize::try_from(extra.div_ceil(quantum)).unwrap_or(usize::MAX)
}
