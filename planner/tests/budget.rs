//! The budget solver and the Pareto frontier, checked against brute force on small graphs.

use std::collections::{BTreeMap, BTreeSet};

use ir::{plan::LayerRef, EntityId, Graph, UnitId};
use planner::{
    budget::{plan_within, BudgetError, Granularity, Search, DEFAULT_STEPS, EXHAUSTIVE_LIMIT},
    config::{self, PlanConfig},
    cost::HwProfile,
    pareto,
    plan::plan_resolved,
};
use testkit::Builder;

const UNITS: [(&str, &[(&str, &str)]); 2] = [
    ("SAVE_ATTN", &[("attn.begin", "attn.end")]),
    ("SAVE_MLP", &[("mlp.begin", "mlp.end")]),
];

/// Three layers of two kept regions; backward reads every forward value, last layer first, so
/// activations (not gradients) make the peak.
fn deep() -> Graph {
    let mut b = Builder::new(3, &UNITS);
    let x = b.input("x");
    let mut h = x;
    let mut reads = Vec::new();
    for l in 0..3 {
        b.layer(Some(l));
        for (begin, end) in [("attn.begin", "attn.end"), ("mlp.begin", "mlp.end")] {
            let m = b.marker(begin, &h);
            let a = b.node("aten.mm.default", &[&m, &m]).1;
            let c = b.op(&a);
            let e = b.marker(end, &c);
            h = b.op(&e);
            reads.extend([a, c, h.clone()]);
        }
    }
    b.layer(None);
    reads.reverse();
    b.backward_through("t", &reads);
    b.build()
}

/// Every per-layer choice of unit subsets: (peak, replay seconds).
fn brute_force(graph: &Graph, hw: &HwProfile) -> Vec<(u64, f64)> {
    let config = PlanConfig::default();
    let resolved = config::resolve(graph, &config).unwrap();
    let model = graph.model_by_name("main").unwrap();
    let mut outcomes = Vec::new();
    for choice in 0..(4u32.pow(3)) {
        let layer_units: BTreeMap<_, _> = (0..3)
            .map(|l| {
                let o = (choice / 4u32.pow(l)) % 4;
                let units = (0..2)
                    .filter(|u| o >> u & 1 == 1)
                    .map(UnitId::from_index)
                    .collect();
                (LayerRef { model, layer: l }, units)
            })
            .collect();
        let plan = plan_resolved(
            graph,
            &config,
            resolved.clone().with_layer_units(layer_units),
            hw,
        )
        .unwrap();
        outcomes.push((plan.memory.peak_bytes.unwrap(), plan.cost.replay_time_s));
    }
    outcomes
}

#[test]
fn m3_the_budget_plan_fits_and_matches_brute_force() {
    let graph = deep();
    let hw = HwProfile::default();
    let outcomes = brute_force(&graph, &hw);
    let floor = outcomes.iter().map(|o| o.0).min().unwrap();
    let ceiling = outcomes.iter().map(|o| o.0).max().unwrap();
    assert!(floor < ceiling, "the graph must offer a trade-off");
    for budget in [floor, (floor + ceiling) / 2, ceiling - 64, ceiling] {
        let plan = plan_within(&graph, &PlanConfig::default(), &hw, budget).unwrap();
        let peak = plan.memory.peak_bytes.unwrap();
        assert!(peak <= budget, "peak {peak} over budget {budget}");
        let optimum = outcomes
            .iter()
            .filter(|o| o.0 <= budget)
            .map(|o| o.1)
            .fold(f64::INFINITY, f64::min);
        assert!(
            plan.cost.replay_time_s <= optimum * (1.0 + 1e-9),
            "budget {budget}: solver {} s, brute force {optimum} s",
            plan.cost.replay_time_s
        );
    }
}

#[test]
fn m3_an_infeasible_budget_states_the_smallest_peak() {
    let graph = deep();
    let hw = HwProfile::default();
    let floor = brute_force(&graph, &hw).iter().map(|o| o.0).min().unwrap();
    match plan_within(&graph, &PlanConfig::default(), &hw, floor - 1) {
        Err(e @ BudgetError::Infeasible { .. }) => {
            assert!(e.to_string().contains(&format!("{floor} B")), "{e}");
        }
        other => panic!("expected infeasible, got {:?}", other.map(|p| p.memory)),
    }
}

/// With nothing to choose (no layer checkpointed, or no units), the frontier is the one plan
/// there is, with the peak its full plan reports, and a budget below that peak is infeasible.
#[test]
fn m3_with_no_layer_to_choose_the_frontier_is_the_full_plan_and_smaller_budgets_are_infeasible() {
    let graph = deep();
    let hw = HwProfile::default();
    let config = PlanConfig {
        recompute_ratio: 0.0,
        ..PlanConfig::default()
    };
    let full = planner::plan::plan(&graph, &config, &hw).unwrap();
    let peak = full.memory.peak_bytes.unwrap();
    let search = Search::new(&graph, &config, &hw).unwrap();
    let front = search.frontier(DEFAULT_STEPS).unwrap();
    let peaks: Vec<u64> = front.iter().map(|p| p.figures.peak_bytes).collect();
    assert_eq!(peaks, vec![peak]);
    assert_eq!(search.within(peak).unwrap().memory.peak_bytes, Some(peak));
    match search.within(peak - 1) {
        Err(BudgetError::Infeasible { smallest, .. }) => assert_eq!(smallest, peak),
        other => panic!("expected infeasible, got {:?}", other.map(|p| p.memory)),
    }
}

#[test]
fn m3_the_pareto_frontier_is_the_brute_force_frontier() {
    let graph = deep();
    let hw = HwProfile::default();
    let outcomes = brute_force(&graph, &hw);
    let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
    let front = pareto::frontier(&search, 64).unwrap();
    // No frontier point is beaten by any configuration on both axes.
    for p in &front {
        assert!(!outcomes
            .iter()
            .any(|o| o.0 < p.peak_bytes && o.1 < p.replay_time_s * (1.0 - 1e-9)));
    }
    // Its ends are keeping nothing and the fastest configuration.
    assert_eq!(
        front[0].peak_bytes,
        outcomes.iter().map(|o| o.0).min().unwrap()
    );
    let fastest = outcomes.iter().map(|o| o.1).fold(f64::INFINITY, f64::min);
    assert!((front.last().unwrap().replay_time_s - fastest).abs() <= fastest * 1e-9);
    assert!(front
        .windows(2)
        .all(|w| w[0].peak_bytes < w[1].peak_bytes && w[0].replay_time_s > w[1].replay_time_s));
    let svg = pareto::svg(&graph, &front);
    assert_eq!(svg.matches("<circle").count(), front.len());
    assert_svg_labels_fit(&svg);
}

#[test]
fn m3_op_granularity_fits_and_never_loses_to_unit_granularity() {
    let graph = deep();
    let hw = HwProfile::default();
    let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
    let ceiling = brute_force(&graph, &hw).iter().map(|o| o.0).max().unwrap();
    let mut chose_ops = false;
    for step in 0..=8 {
        let floor = search.floor().unwrap();
        let budget = floor + (ceiling - floor) * step / 8;
        let units = search.within(budget).unwrap();
        let ops = search.within_ops(budget).unwrap();
        assert!(ops.memory.peak_bytes.unwrap() <= budget);
        assert!(ops.cost.replay_time_s <= units.cost.replay_time_s);
        chose_ops |= ops
            .nodes
            .iter()
            .any(|n| n.reason == ir::plan::Reason::ChosenOp);
    }
    assert!(chose_ops, "some budget leaves room for single ops");
}

/// The exporter's expert-parallel MoE golden, deepened to `layers` identical decoder layers.
fn deep_golden(layers: u32) -> Graph {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/moe_ep2.pb");
    let wire = ir::io::read_wire(&path).unwrap();
    Graph::from_wire(testkit::deepen(&wire, "main", 0, layers).unwrap()).unwrap()
}

/// The GLM/DSA golden (a main model and a nested MTP model), with the MTP model's units
/// declared in reverse order: unit indices differ between the models, names do not.
fn two_models_with_units_in_different_orders() -> Graph {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/glm_dsa_ep2.pb");
    let mut wire = ir::io::read_wire(&path).unwrap();
    let mtp = wire.models.iter_mut().find(|m| m.name == "mtp").unwrap();
    mtp.units.reverse();
    Graph::from_wire(wire).unwrap()
}

/// Graphs past the exhaustive limit: the heuristic and the sampled frontier run.
fn large_searches() -> Vec<(&'static str, Graph)> {
    vec![
        // 10 layers of 4 units: 16^10 combinations.
        ("moe_ep2 x10", deep_golden(10)),
        // 3 checkpointed layers of 5 units: 32^3 combinations.
        (
            "glm_dsa_ep2, MTP units reversed",
            two_models_with_units_in_different_orders(),
        ),
    ]
}

/// (peak, replay seconds) of `planner plan --keep S` for every set S of declared unit names:
/// what a user picks by hand, planned independently of the budget search.
fn uniform_keeps(graph: &Graph, hw: &HwProfile) -> Vec<(u64, f64)> {
    let units = config::declared_units(graph);
    (0..1u32 << units.len())
        .map(|set| {
            let keep: Vec<String> = (0..units.len())
                .filter(|u| set >> u & 1 == 1)
                .map(|u| units[u].clone())
                .collect();
            let config = PlanConfig {
                keep: config::parse_keep(&keep).unwrap(),
                ..PlanConfig::default()
            };
            let plan = planner::plan::plan(graph, &config, hw).unwrap();
            (plan.memory.peak_bytes.unwrap(), plan.cost.replay_time_s)
        })
        .collect()
}

#[test]
fn m3_on_large_searches_the_budget_plan_beats_every_uniform_keep_that_fits() {
    let hw = HwProfile::default();
    for (name, graph) in large_searches() {
        let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
        assert!(search.combinations() > EXHAUSTIVE_LIMIT, "{name}");
        let uniform = uniform_keeps(&graph, &hw);
        let ceiling = uniform.iter().map(|u| u.0).max().unwrap();
        let (mut worst, mut best) = (f64::NEG_INFINITY, f64::INFINITY);
        for step in 0..=8 {
            let floor = search.floor().unwrap();
            let budget = floor + (ceiling - floor) * step / 8;
            let plan = search.within(budget).unwrap();
            assert!(plan.memory.peak_bytes.unwrap() <= budget, "{name}");
            let best_uniform = uniform
                .iter()
                .filter(|u| u.0 <= budget)
                .map(|u| u.1)
                .fold(f64::INFINITY, f64::min);
            let ratio = plan.cost.replay_time_s / best_uniform - 1.0;
            (worst, best) = (worst.max(ratio), best.min(ratio));
            assert!(
                plan.cost.replay_time_s <= best_uniform * (1.0 + 1e-9),
                "{name}, budget {budget}: solver {} s, best uniform keep {best_uniform} s",
                plan.cost.replay_time_s
            );
        }
        println!(
            "{name}: replay time vs the best uniform keep that fits, over 9 budgets: {:+.1}% to {:+.1}%",
            best * 100.0,
            worst * 100.0
        );
    }
}

#[test]
fn m3_on_large_searches_no_uniform_keep_lies_outside_the_pareto_frontier() {
    let hw = HwProfile::default();
    for (name, graph) in large_searches() {
        let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
        let front = pareto::frontier(&search, 16).unwrap();
        for (peak, time) in uniform_keeps(&graph, &hw) {
            assert!(
                front
                    .iter()
                    .any(|p| p.peak_bytes <= peak && p.replay_time_s <= time),
                "{name}: a uniform keep ({peak} B, {time} s) is outside the frontier"
            );
        }
    }
}

/// `layers` layers where keeping SAVE_ATTN is rejected (an in-place op writes its kept output
/// and a running statistic, which no replay may write twice); keeping SAVE_MLP is fine and
/// saves replay time.
fn one_unit_rejected(layers: u32) -> Graph {
    let mut b = Builder::new(layers, &UNITS);
    let x = b.input("x");
    let stats = b.input("running_stats");
    let mut h = x;
    let mut reads = Vec::new();
    for l in 0..layers {
        b.layer(Some(l));
        let m = b.marker("attn.begin", &h);
        let kept = b.node("aten.mm.default", &[&m, &m]).1;
        let written = b.write_in_place("mystery.normalise_.default", &[&kept, &stats], &[]);
        // Worth keeping on its own: backward reads it.
        let useful = b.node("aten.mm.default", &[&written, &written]).1;
        let e = b.marker("attn.end", &useful);
        let m = b.marker("mlp.begin", &e);
        let a = b.node("aten.mm.default", &[&m, &m]).1;
        let e = b.marker("mlp.end", &a);
        h = b.op(&e);
        reads.extend([kept, useful, a, h.clone()]);
    }
    b.layer(None);
    reads.reverse();
    b.backward_through("t", &reads);
    b.build()
}

#[test]
fn m3_searches_never_propose_a_configuration_plan_rejects() {
    // Two layers are searched exhaustively, six by the knapsack and local search.
    for layers in [2, 6] {
        searches_skip_rejected_configurations(&one_unit_rejected(layers));
    }
}

fn searches_skip_rejected_configurations(graph: &Graph) {
    let hw = HwProfile::default();
    let keep_attn = PlanConfig {
        keep: config::parse_keep(&["save_attn".to_owned()]).unwrap(),
        ..PlanConfig::default()
    };
    assert!(planner::plan::plan(graph, &keep_attn, &hw)
        .unwrap()
        .has_errors());
    let search = Search::new(graph, &PlanConfig::default(), &hw).unwrap();
    let front = pareto::frontier(&search, 16).unwrap();
    let attn = ir::UnitId::from_index(0);
    assert!(front.len() >= 2, "keeping SAVE_MLP is a trade-off");
    for p in &front {
        assert!(
            p.layer_keep.iter().all(|l| !l.units.contains(&attn)),
            "{:?}",
            p.layer_keep
        );
    }
    let plan = search.within(u64::MAX / 2).unwrap();
    assert!(!plan.has_errors());
    assert!(plan.cost.replay_time_s < search.nothing().unwrap().cost.replay_time_s);
}

/// Every text label of the SVG lies inside its 720 × 440 image (width estimated at 0.6 em a
/// character), and each axis has several tick labels.
fn assert_svg_labels_fit(svg: &str) {
    let attr = |tag: &str, name: &str| -> Option<String> {
        let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
        Some(tag[start..].split('"').next()?.to_owned())
    };
    let (mut x_ticks, mut y_ticks) = (0, 0);
    for piece in svg.split("<text").skip(1) {
        let (tag, rest) = piece.split_once('>').unwrap();
        let label = rest.split("</text>").next().unwrap();
        if tag.contains("rotate") {
            continue;
        }
        let size: f64 = attr(tag, "font-size").map_or(11.0, |s| s.parse().unwrap());
        let x: f64 = attr(tag, "x").unwrap().parse().unwrap();
        let y: f64 = attr(tag, "y").unwrap().parse().unwrap();
        let width = label.chars().count() as f64 * size * 0.6;
        let (left, right) = match attr(tag, "text-anchor").as_deref() {
            Some("end") => (x - width, x),
            Some("middle") => (x - width / 2.0, x + width / 2.0),
            _ => (x, x + width),
        };
        assert!(
            left >= 0.0 && right <= 720.0,
            "`{label}` spans {left:.0}..{right:.0}"
        );
        assert!(y > size && y <= 440.0, "`{label}` at y {y}");
        if label.ends_with('s') && attr(tag, "text-anchor").as_deref() == Some("end") {
            y_ticks += 1;
        } else if label.ends_with('B') {
            x_ticks += 1;
        }
    }
    assert!(
        x_ticks >= 3 && y_ticks >= 3,
        "{x_ticks} x ticks, {y_ticks} y ticks"
    );
}

/// `count + 1` budgets evenly spaced from the search's floor to `ceiling`.
fn sweep(search: &Search, ceiling: u64, count: u64) -> Vec<u64> {
    let floor = search.floor().unwrap();
    (0..=count)
        .map(|k| floor + (ceiling - floor) * k / count)
        .collect()
}

/// The largest peak of any uniform `--keep`.
fn uniform_ceiling(graph: &Graph, hw: &HwProfile) -> u64 {
    uniform_keeps(graph, hw).iter().map(|u| u.0).max().unwrap()
}

/// The deep MoE golden of 8 layers (2.4k nodes) and the large searches.
fn swept_graphs() -> Vec<(&'static str, Graph)> {
    let mut graphs = vec![("moe_ep2 x8", deep_golden(8))];
    graphs.extend(large_searches());
    graphs
}

#[test]
fn m3_a_larger_budget_never_answers_slower() {
    let hw = HwProfile::default();
    for (name, graph) in swept_graphs() {
        let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
        let mut previous: Option<(u64, f64)> = None;
        for budget in sweep(&search, uniform_ceiling(&graph, &hw), 96) {
            let plan = search.within(budget).unwrap();
            let time = plan.cost.replay_time_s;
            if let Some((smaller, slower)) = previous {
                assert!(
                    time <= slower,
                    "{name}: budget {budget} answers {time} s, budget {smaller} answers {slower} s"
                );
            }
            previous = Some((budget, time));
        }
    }
}

#[test]
fn m3_no_budget_answer_lies_below_the_pareto_frontier() {
    let hw = HwProfile::default();
    for (name, graph) in swept_graphs() {
        let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
        let front = pareto::frontier(&search, DEFAULT_STEPS).unwrap();
        for budget in sweep(&search, uniform_ceiling(&graph, &hw), 96) {
            let plan = search.within(budget).unwrap();
            let (peak, time) = (plan.memory.peak_bytes.unwrap(), plan.cost.replay_time_s);
            assert!(
                front
                    .iter()
                    .any(|p| p.peak_bytes <= peak && p.replay_time_s <= time),
                "{name}: the answer for budget {budget} ({peak} B, {time} s) beats the frontier"
            );
        }
    }
}

/// The widest gap between consecutive points of `front`, and its peak range.
fn widest_gap(front: &[pareto::Point]) -> (u64, u64) {
    let range = front.last().unwrap().peak_bytes - front[0].peak_bytes;
    let widest = front
        .windows(2)
        .map(|w| w[1].peak_bytes - w[0].peak_bytes)
        .max()
        .unwrap_or(0);
    (widest, range)
}

#[test]
fn m3_on_deep_graphs_a_gap_wider_than_a_step_holds_no_single_layer_change_of_its_ends() {
    let hw = HwProfile::default();
    let graph = deep_golden(32);
    let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
    for steps in [8, DEFAULT_STEPS] {
        let front = pareto::frontier(&search, steps).unwrap();
        let (widest, range) = widest_gap(&front);
        println!(
            "moe_ep2 x32, {steps} steps: {} points, widest gap {:.1}% of the peak range",
            front.len(),
            100.0 * widest as f64 / range as f64
        );
        // Wider than a step only where no single-layer change of either end lies inside (the
        // peaks of this graph move in 4 KiB steps, above 1/32 of its range).
        let wide = assert_wide_gaps_hold_no_single_layer_change(
            "moe_ep2 x32",
            &graph,
            &search,
            &front,
            steps,
        );
        println!("{wide} gaps wider than 1/{steps} of the range, none fillable");
    }
}

/// Checks that no single-layer change of either end of a gap wider than `1 / steps` of the
/// frontier's peak range lies inside it, faster than its faster end; returns how many such
/// gaps there are.
fn assert_wide_gaps_hold_no_single_layer_change(
    name: &str,
    graph: &Graph,
    search: &Search,
    front: &[pareto::Point],
    steps: u64,
) -> usize {
    let (_, range) = widest_gap(front);
    let mut wide = 0;
    for w in front.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if b.peak_bytes - a.peak_bytes <= range / steps {
            continue;
        }
        wide += 1;
        for end in [a, b] {
            for f in search
                .composed(&neighbours(graph, &choice_of(end)))
                .into_iter()
                .flatten()
            {
                let inside = a.peak_bytes < f.peak_bytes && f.peak_bytes < b.peak_bytes;
                assert!(
                    // Equal times summed in another order differ in the last bits.
                    !(inside && f.replay_time_s < a.replay_time_s * (1.0 - 1e-12)),
                    "{name}: ({} B, {} s) lies in the gap from ({} B, {} s) to ({} B, {} s)",
                    f.peak_bytes,
                    f.replay_time_s,
                    a.peak_bytes,
                    a.replay_time_s,
                    b.peak_bytes,
                    b.replay_time_s
                );
            }
        }
    }
    wide
}

/// A frontier point's choice, as the solver takes it.
fn choice_of(point: &pareto::Point) -> BTreeMap<LayerRef, Vec<UnitId>> {
    point
        .layer_keep
        .iter()
        .map(|l| (l.at, l.units.clone()))
        .collect()
}

/// Every choice that differs from `choice` in one layer, among the units each layer's model
/// declares.
fn neighbours(
    graph: &Graph,
    choice: &BTreeMap<LayerRef, Vec<UnitId>>,
) -> Vec<BTreeMap<LayerRef, Vec<UnitId>>> {
    let mut out = Vec::new();
    for &at in choice.keys() {
        let units = graph.model(at.model).units.len();
        for mask in 0..1u32 << units {
            let mut next = choice.clone();
            next.insert(
                at,
                (0..units)
                    .filter(|u| mask >> u & 1 == 1)
                    .map(UnitId::from_index)
                    .collect(),
            );
            out.push(next);
        }
    }
    out
}

#[test]
fn m3_a_wide_frontier_gap_has_no_single_layer_change_of_its_ends_inside() {
    let hw = HwProfile::default();
    for (name, graph) in swept_graphs() {
        let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
        let front = pareto::frontier(&search, DEFAULT_STEPS).unwrap();
        let (widest, range) = widest_gap(&front);
        println!(
            "{name}: {} points, widest gap {:.1}% of the peak range",
            front.len(),
            100.0 * widest as f64 / range as f64
        );
        assert_wide_gaps_hold_no_single_layer_change(name, &graph, &search, &front, DEFAULT_STEPS);
    }
}

/// Every per-layer choice of `graph`'s single model, composed: (peak, replay seconds).
fn every_combination(graph: &Graph, search: &Search) -> Vec<(u64, f64)> {
    let model = graph.model_by_name("main").unwrap();
    let units = graph.model(model).units.len();
    let layers = graph.model(model).num_layers;
    let options = 1u64 << units;
    let choices: Vec<BTreeMap<_, _>> = (0..options.pow(layers))
        .map(|k| {
            (0..layers)
                .map(|l| {
                    let o = k / options.pow(l) % options;
                    let kept = (0..units)
                        .filter(|u| o >> u & 1 == 1)
                        .map(UnitId::from_index)
                        .collect();
                    (LayerRef { model, layer: l }, kept)
                })
                .collect()
        })
        .collect();
    search
        .composed(&choices)
        .into_iter()
        .flatten()
        .map(|f| (f.peak_bytes, f.replay_time_s))
        .collect()
}

#[test]
fn m3_optimality_gap_against_every_combination() {
    let hw = HwProfile::default();
    // 3 layers of 4 units: 4096 combinations, past the exhaustive limit.
    let graph = deep_golden(3);
    let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
    assert!(search.combinations() > EXHAUSTIVE_LIMIT);
    let every = every_combination(&graph, &search);
    let ceiling = every.iter().map(|o| o.0).max().unwrap();
    let (mut worst, mut sum, mut count) = (0.0f64, 0.0, 0);
    for budget in sweep(&search, ceiling, 64) {
        let plan = search.within(budget).unwrap();
        let optimum = every
            .iter()
            .filter(|o| o.0 <= budget)
            .map(|o| o.1)
            .fold(f64::INFINITY, f64::min);
        let gap = plan.cost.replay_time_s / optimum - 1.0;
        (worst, sum, count) = (worst.max(gap), sum + gap, count + 1);
    }
    println!(
        "moe_ep2 x3, 65 budgets: replay time over the optimum of 4096 combinations: mean {:.2}%, worst {:.2}%",
        100.0 * sum / count as f64,
        100.0 * worst
    );
    // Measured 1.95% (mean 0.21%) since replay runs op by op before first use.
    assert!(worst <= 0.025, "worst gap {:.2}%", 100.0 * worst);
}

/// A caller that asks the search to stop after `after` candidate plans.
struct StopAfter {
    after: usize,
    planned: std::sync::atomic::AtomicUsize,
}

impl planner::progress::Progress for StopAfter {
    fn stage(&self, _: &str, _: Option<u64>) {}
    fn advance(&self) {
        self.planned
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    fn interrupted(&self) -> bool {
        self.planned.load(std::sync::atomic::Ordering::Relaxed) >= self.after
    }
}

#[test]
fn an_interrupted_search_stops_before_its_next_candidate() {
    let graph = deep();
    let (config, hw) = (PlanConfig::default(), HwProfile::default());
    let search = |after| {
        let stop = StopAfter {
            after,
            planned: Default::default(),
        };
        let answer = Search::with_progress(&graph, &config, &hw, &stop)
            .and_then(|search| search.within(u64::MAX));
        (answer, stop.planned.into_inner())
    };
    let (answer, all) = search(usize::MAX);
    assert!(answer.is_ok(), "{answer:?}");
    for after in [0, 1, all / 2] {
        let (answer, planned) = search(after);
        assert!(
            matches!(answer, Err(BudgetError::Interrupted)),
            "{answer:?}"
        );
        assert!(planned < all, "{planned} of {all} candidates after {after}");
    }
}

/// Every per-layer choice of recompute, save or offload for each unit of [`deep`], each with
/// the layer's inputs offloaded or not: the full plans `plan` accepts, as (peak, replay plus
/// exposed transfer seconds).
fn brute_force_with_offload(graph: &Graph, hw: &HwProfile) -> Vec<(u64, f64)> {
    let config = PlanConfig::default();
    let resolved = config::resolve(graph, &config).unwrap();
    let model = graph.model_by_name("main").unwrap();
    let mut outcomes = Vec::new();
    // Per unit and layer: 0 recompute, 1 save, 2 offload; then a bit per layer: its inputs
    // offloaded.
    for choice in 0..9u32.pow(3) * 8 {
        let (mut keep, mut offload, mut inputs) =
            (BTreeMap::new(), BTreeMap::new(), BTreeSet::new());
        for l in 0..3 {
            let at = LayerRef { model, layer: l };
            if (choice / 9u32.pow(3)) >> l & 1 == 1 {
                inputs.insert(at);
            }
            let of_unit = |u: u32| (choice % 9u32.pow(3) / 3u32.pow(2 * l + u)) % 3;
            let units = |wanted: &dyn Fn(u32) -> bool| -> Vec<UnitId> {
                (0..2)
                    .filter(|&u| wanted(of_unit(u)))
                    .map(|u| UnitId::from_index(u as usize))
                    .collect()
            };
            keep.insert(at, units(&|d| d >= 1));
            offload.insert(at, units(&|d| d == 2));
        }
        let plan = plan_resolved(
            graph,
            &config,
            resolved
                .clone()
                .with_layer_units(keep)
                .with_layer_offload(offload, inputs),
            hw,
        )
        .unwrap();
        if !plan.has_errors() {
            outcomes.push((plan.memory.peak_bytes.unwrap(), step_cost(&plan)));
        }
    }
    outcomes
}

fn step_cost(plan: &ir::plan::Plan) -> f64 {
    plan.cost.replay_time_s + plan.cost.exposed_transfer_time_s
}

/// `--budget-offload` over every budget from the smallest peak to the largest, on host links
/// from free to slower than the replay they save, overlapped with compute or not, and with a
/// host memory that takes only some of the offloaded values: its answer fits, is never slower
/// than the answer without offload (and answers where that one is infeasible), offloads only
/// what its layers keep, and is within 5% of the best of all 5,832 choices of recompute, save
/// or offload per unit and layer, each layer's inputs offloaded or not (measured: at most
/// 4.0%, on 6 of the 165 budgets; 13.7% with one order of prefixes instead of three). Where
/// copies are cheap, some budget that keeping alone meets is met faster.
#[test]
fn budget_offload_fits_never_loses_to_save_or_recompute_and_is_near_brute_force() {
    let graph = deep();
    // Every kept value offloaded: what the host-memory profile below takes half of.
    let host_peak_of_all = {
        let config = PlanConfig {
            keep: ir::plan::Keep::All,
            offload: ir::plan::Offload {
                units: vec!["SAVE_ATTN".to_owned(), "SAVE_MLP".to_owned()],
                ..Default::default()
            },
            ..PlanConfig::default()
        };
        let plan = planner::plan::plan(&graph, &config, &HwProfile::default()).unwrap();
        plan.memory.host_peak_bytes
    };
    let half_the_host = (host_peak_of_all / 2) as f64;
    let profiles = [
        (1e15, true, None, true),
        (64e9, false, None, true),
        (3e6, true, None, true),
        (3e5, false, None, false),
        (1e15, true, Some(half_the_host), true),
    ];
    for (host_bytes_per_s, asynchronous, host_memory, pays) in profiles {
        let default = HwProfile::default();
        let hw = HwProfile {
            host_bytes_per_s,
            asynchronous,
            host_memory_bytes: host_memory.unwrap_or(default.host_memory_bytes),
            ..default
        };
        let context = format!(
            "host link {host_bytes_per_s} B/s, asynchronous {asynchronous}, host memory {}",
            hw.host_memory_bytes
        );
        let outcomes = brute_force_with_offload(&graph, &hw);
        let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
        let floor = outcomes.iter().map(|o| o.0).min().unwrap();
        let ceiling = outcomes.iter().map(|o| o.0).max().unwrap();
        let mut faster_than_keeping = 0;
        for step in 0..=32 {
            let budget = floor + (ceiling - floor) * step / 32;
            let best = outcomes
                .iter()
                .filter(|o| o.0 <= budget)
                .map(|o| o.1)
                .fold(f64::INFINITY, f64::min);
            let answer = search
                .answer(budget, Granularity::Unit, true)
                .unwrap_or_else(|e| panic!("{context}, budget {budget}: {e}"));
            assert!(answer.memory.peak_bytes.unwrap() <= budget && !answer.has_errors());
            for l in &answer.config.layer_offload {
                let kept = answer
                    .config
                    .layer_keep
                    .iter()
                    .find(|k| k.at == l.at)
                    .unwrap();
                assert!(l.units.iter().all(|u| kept.units.contains(u)), "{l:?}");
            }
            if let Ok(plain) = search.within(budget) {
                assert!(
                    step_cost(&answer) <= step_cost(&plain),
                    "{context}, {budget}"
                );
                faster_than_keeping += usize::from(step_cost(&answer) < step_cost(&plain));
            }
            let gap = step_cost(&answer) / best - 1.0;
            assert!(
                (-1e-9..=0.05).contains(&gap),
                "{context}, budget {budget}: gap {gap}"
            );
        }
        assert_eq!(
            faster_than_keeping > 0,
            pays,
            "{context}: {faster_than_keeping} budgets met faster by offloading"
        );
    }
}

/// Offload is chosen by its cost: when every copy is exposed on a slow host link, no answer
/// offloads where keeping or recomputing fits.
#[test]
fn budget_offload_leaves_alone_what_a_slow_host_link_would_cost_more() {
    let graph = deep();
    let hw = HwProfile {
        host_bytes_per_s: 1.0,
        ..HwProfile::default()
    };
    let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
    let floor = search.floor().unwrap();
    let ceiling = uniform_ceiling(&graph, &hw);
    for step in 0..=8 {
        let budget = floor + (ceiling - floor) * step / 8;
        let answer = search.answer(budget, Granularity::Unit, true).unwrap();
        assert!(answer.config.layer_offload.is_empty(), "budget {budget}");
        assert_eq!(answer.memory.offloaded_bytes, 0);
    }
}

/// `pareto --with-offload` on host links from free to slow: its points are sorted, none beats
/// another, each is what its full plan reports, and every point of the frontier without
/// offload is on it or beaten by one of its points; where copies are cheap some point
/// offloads and reaches below the smallest peak without offload.
#[test]
fn the_offload_frontier_beats_or_holds_every_point_without_offload() {
    let graph = deep();
    let model = graph.model_by_name("main").unwrap();
    for (host_bytes_per_s, asynchronous) in [(1e15, true), (3e5, false)] {
        let hw = HwProfile {
            host_bytes_per_s,
            asynchronous,
            ..HwProfile::default()
        };
        let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
        let plain = pareto::frontier(&search, DEFAULT_STEPS).unwrap();
        let front = pareto::frontier_with_offload(&search, DEFAULT_STEPS).unwrap();
        let beats = |q: &pareto::Point, p: &pareto::Point| {
            q.peak_bytes <= p.peak_bytes
                && q.time_s() <= p.time_s()
                && (q.peak_bytes < p.peak_bytes || q.time_s() < p.time_s())
        };
        assert!(front.windows(2).all(|w| w[0].peak_bytes < w[1].peak_bytes));
        for p in &front {
            assert!(!front.iter().any(|q| beats(q, p)));
            let by_layer = |layers: &[ir::plan::LayerKeep]| -> BTreeMap<LayerRef, Vec<UnitId>> {
                layers.iter().map(|l| (l.at, l.units.clone())).collect()
            };
            let offloaded = p.layer_offload.iter().map(|l| (l.at, l.units.clone()));
            let inputs = p.layer_offload.iter().filter(|l| l.layer_input);
            let resolved = config::resolve(&graph, &PlanConfig::default())
                .unwrap()
                .with_layer_units(by_layer(&p.layer_keep))
                .with_layer_offload(offloaded.collect(), inputs.map(|l| l.at).collect());
            let plan = plan_resolved(&graph, &PlanConfig::default(), resolved, &hw).unwrap();
            assert_eq!(plan.memory.peak_bytes, Some(p.peak_bytes));
            assert_eq!(step_cost(&plan), p.time_s());
            assert!(p.layer_offload.iter().all(|l| l.at.model == model));
        }
        for p in &plain {
            assert!(
                front.iter().any(|q| q == p || beats(q, p)),
                "{p:?} is neither on the offload frontier nor beaten there"
            );
        }
        if asynchronous {
            assert!(front[0].peak_bytes < plain[0].peak_bytes);
            assert!(!front[0].layer_offload.is_empty());
        }
    }
}

/// Whole-layer recompute keeps every layer's input on the device: a budget below that floor
/// is met by moving layer inputs to host memory, which the answer states per layer, and which
/// the search refuses without `--budget-offload`.
#[test]
fn budget_offload_meets_a_budget_below_whole_layer_recompute_by_offloading_layer_inputs() {
    let graph = deep();
    let hw = HwProfile::default();
    let search = Search::new(&graph, &PlanConfig::default(), &hw).unwrap();
    let floor = search.floor().unwrap();
    let budget = floor - 1;
    assert!(matches!(
        search.answer(budget, Granularity::Unit, false),
        Err(BudgetError::Infeasible { .. })
    ));
    let answer = search.answer(budget, Granularity::Unit, true).unwrap();
    assert!(answer.memory.peak_bytes.unwrap() <= budget && !answer.has_errors());
    let moved: Vec<_> = answer
        .config
        .layer_offload
        .iter()
        .filter(|l| l.layer_input)
        .collect();
    assert!(!moved.is_empty(), "{:?}", answer.config.layer_offload);
    let offloaded_inputs: Vec<_> = answer
        .saved
        .iter()
        .filter(|s| s.offloaded && s.kind == ir::plan::SavedKind::LayerInput)
        .collect();
    assert!(!offloaded_inputs.is_empty());
    for s in offloaded_inputs {
        let at = LayerRef {
            model: s.model.unwrap(),
            layer: s.layer.unwrap(),
        };
        assert!(
            moved.iter().any(|l| l.at == at),
            "{s:?} offloaded by no choice"
        );
    }
    assert!(answer.memory.offloaded_bytes > 0);
}
