//! Incremental planning: the peak, replay time and saved bytes composed per layer equal those
//! of a full plan, on every golden graph and on random graphs, for both executors; and the
//! candidates a search visits are among them.

use std::collections::BTreeMap;

use ir::{
    plan::{Collectives, Executor, LayerRef, RandomOps},
    EntityId, Graph, Phase, UnitId,
};
use planner::{
    budget::Search,
    compose::Figures,
    config::{self, PlanConfig},
    cost::HwProfile,
    plan::plan_resolved,
};
use proptest::prelude::*;
use testkit::Builder;

/// The figures of the full plan of per-layer unit choices; none if `plan` rejects them.
fn planned(
    graph: &Graph,
    config: &PlanConfig,
    choice: &BTreeMap<LayerRef, Vec<UnitId>>,
) -> Option<Figures> {
    let base = PlanConfig {
        keep: ir::plan::Keep::Nothing,
        ..config.clone()
    };
    let resolved = config::resolve(graph, &base)
        .unwrap()
        .with_layer_units(choice.clone());
    let plan = plan_resolved(graph, &base, resolved, &HwProfile::default()).unwrap();
    (!plan.has_errors()).then(|| Figures {
        peak_bytes: plan.memory.peak_bytes.unwrap(),
        replay_time_s: plan.cost.replay_time_s,
        saved_bytes: plan.memory.saved_bytes,
    })
}

/// Checkpointed layers of models with units (every layer is checkpointed at ratio 1) and
/// their models' unit counts.
fn searched(graph: &Graph) -> Vec<(LayerRef, usize)> {
    let mut at: Vec<(LayerRef, usize)> = graph
        .nodes()
        .values()
        .filter(|n| n.phase == Phase::Forward && !graph.model(n.model).units.is_empty())
        .filter_map(|n| {
            let layer = n.layer?;
            let units = graph.model(n.model).units.len();
            Some((
                LayerRef {
                    model: n.model,
                    layer,
                },
                units,
            ))
        })
        .collect();
    at.sort_unstable();
    at.dedup();
    at
}

/// `count` per-layer choices drawn by a fixed generator from `seed`, as a search visits them:
/// keeping nothing, keeping everything, a random choice, then a walk that changes one layer at
/// a time, starting afresh from a random choice now and then.
fn choices(graph: &Graph, count: usize, seed: u64) -> Vec<BTreeMap<LayerRef, Vec<UnitId>>> {
    let layers = searched(graph);
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state >> 33
    };
    let mut masks: Vec<u64> = vec![0; layers.len()];
    let mut out = Vec::with_capacity(count);
    for k in 0..count {
        match k {
            0 => {}
            1 => {
                for (m, &(_, units)) in masks.iter_mut().zip(&layers) {
                    *m = (1 << units) - 1;
                }
            }
            _ if k % 8 == 2 => {
                for (m, &(_, units)) in masks.iter_mut().zip(&layers) {
                    *m = next() % (1 << units);
                }
            }
            _ => {
                let l = (next() as usize) % layers.len();
                masks[l] = next() % (1 << layers[l].1);
            }
        }
        out.push(
            layers
                .iter()
                .zip(&masks)
                .map(|(&(at, units), &mask)| {
                    let kept = (0..units)
                        .filter(|u| mask >> u & 1 == 1)
                        .map(UnitId::from_index)
                        .collect();
                    (at, kept)
                })
                .collect(),
        );
    }
    out
}

/// Composed and planned figures agree for `count` choices; returns how many were compared.
fn assert_composes(name: &str, graph: &Graph, config: &PlanConfig, count: usize) -> usize {
    let hw = HwProfile::default();
    let search = Search::new(graph, config, &hw).unwrap();
    assert!(search.exact(), "{name}: the composed model is inexact");
    compare(name, graph, config, &search, count)
}

fn compare(name: &str, graph: &Graph, config: &PlanConfig, search: &Search, count: usize) -> usize {
    let mut compared = 0;
    let choices = choices(graph, count, k_seed(name));
    let composed = search.composed(&choices);
    for (k, (choice, composed)) in choices.iter().zip(composed).enumerate() {
        let full = planned(graph, config, choice);
        assert_eq!(
            composed, full,
            "{name}, {config:?}, choice {k}: composed (left) and planned (right) differ"
        );
        compared += 1;
    }
    compared
}

fn k_seed(name: &str) -> u64 {
    name.bytes()
        .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
}

/// The configurations the composition must hold for.
fn configs() -> Vec<PlanConfig> {
    vec![
        PlanConfig::default(),
        PlanConfig {
            executor: Executor::Eager,
            ..PlanConfig::default()
        },
        PlanConfig {
            collectives: Collectives::Save,
            random_ops: RandomOps::Replay,
            ..PlanConfig::default()
        },
    ]
}

#[test]
fn composed_figures_equal_full_plans_on_every_golden() {
    let dir = testkit::golden::repo_root().join("tests/golden");
    let mut graphs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pb"))
        .collect();
    graphs.sort();
    let mut checked = 0;
    for path in graphs {
        let graph = ir::io::load(&path).unwrap();
        if !planner::partition::is_joint(&graph) || searched(&graph).is_empty() {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        for config in configs() {
            checked += assert_composes(&name, &graph, &config, 12);
        }
    }
    assert!(checked > 100, "only {checked} choices compared");
}

#[test]
fn composed_figures_equal_full_plans_on_a_deep_golden() {
    let path = testkit::golden::golden_graph("moe_ep2");
    let wire = ir::io::read_wire(&path).unwrap();
    let graph = Graph::from_wire(testkit::deepen(&wire, "main", 0, 6).unwrap()).unwrap();
    for config in configs() {
        assert_composes("moe_ep2 x6", &graph, &config, 16);
    }
}

const UNITS: [(&str, &[(&str, &str)]); 2] = [
    ("SAVE_ATTN", &[("attn.begin", "attn.end")]),
    ("SAVE_MLP", &[("mlp.begin", "mlp.end")]),
];
const MARKERS: [&str; 4] = ["attn.begin", "attn.end", "mlp.begin", "mlp.end"];

/// One forward op of a random layer; indices pick among the layer's values so far (its input
/// first) or, for `Earlier`, among all earlier forward values.
#[derive(Debug, Clone)]
enum Op {
    Compute(usize),
    Two(usize, usize),
    View(usize),
    Marker(usize, usize),
    InPlace(usize, usize),
    Collective(usize),
    Dropout(usize),
    Earlier(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<usize>().prop_map(Op::Compute),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Op::Two(a, b)),
        1 => any::<usize>().prop_map(Op::View),
        4 => (0..MARKERS.len(), any::<usize>()).prop_map(|(m, x)| Op::Marker(m, x)),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Op::InPlace(a, b)),
        1 => any::<usize>().prop_map(Op::Collective),
        1 => any::<usize>().prop_map(Op::Dropout),
        1 => any::<usize>().prop_map(Op::Earlier),
    ]
}

/// Random layers, the forward values backward reads (by index, in that order), and whether
/// layer 1 runs two micro-batches.
fn layers() -> impl Strategy<Value = (Vec<Vec<Op>>, Vec<usize>, bool)> {
    (
        prop::collection::vec(prop::collection::vec(op(), 2..12), 2..5),
        prop::collection::vec(any::<usize>(), 1..16),
        any::<bool>(),
    )
}

/// Backward reads the values made last first, as a real backward pass does.
fn last_first(mut reads: Vec<usize>, values: usize) -> Vec<usize> {
    for r in &mut reads {
        *r %= values;
    }
    reads.sort_unstable_by(|a, b| b.cmp(a));
    reads
}

fn pick(pool: &[String], i: usize) -> String {
    pool[i % pool.len()].clone()
}

/// The graph of random `layers`; backward reads the forward values `reads` picks, in that
/// order, `last_first` or not.
fn random_graph(layers: &[Vec<Op>], reads: &[usize], micro_batches: bool, in_order: bool) -> Graph {
    let mut b = Builder::new(layers.len() as u32, &UNITS);
    let x = b.input("x");
    let w = b.param("w");
    let mut everything = vec![x.clone()];
    let mut h = x;
    for (l, ops) in layers.iter().enumerate() {
        b.layer(Some(l as u32))
            .micro_batch(u32::from(micro_batches && l == 1));
        let mut pool = vec![h.clone()];
        for op in ops {
            let out = match *op {
                Op::Compute(i) => b.op(&pick(&pool, i)),
                Op::Two(i, j) => {
                    b.node("aten.mm.default", &[&pick(&pool, i), &pick(&pool, j)])
                        .1
                }
                Op::View(i) => b.node("aten.view.default", &[&pick(&pool, i)]).1,
                Op::Marker(m, i) => b.marker(MARKERS[m], &pick(&pool, i)),
                Op::InPlace(i, j) => {
                    b.node("aten.add_.Tensor", &[&pick(&pool, i), &pick(&pool, j)])
                        .1
                }
                Op::Collective(i) => {
                    let sent = b
                        .node(
                            "_c10d_functional.all_to_all_single.default",
                            &[&pick(&pool, i)],
                        )
                        .1;
                    b.node("_c10d_functional.wait_tensor.default", &[&sent]).1
                }
                Op::Dropout(i) => b.node("aten.native_dropout.default", &[&pick(&pool, i)]).1,
                Op::Earlier(i) => b.node("aten.mm.default", &[&pick(&everything, i), &w]).1,
            };
            pool.push(out);
        }
        h = b.op(pool.last().unwrap());
        everything.extend(pool);
        everything.push(h.clone());
    }
    b.layer(None).micro_batch(0);
    let loss = b.op(&h);
    let reads = match in_order {
        true => last_first(reads.to_vec(), everything.len()),
        false => reads.to_vec(),
    };
    let read: Vec<String> = std::iter::once(loss)
        .chain(reads.iter().map(|&i| pick(&everything, i)))
        .collect();
    b.backward_through("t", &read);
    b.build()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Backward in reverse forward order: the composition is exact.
    #[test]
    fn composed_figures_equal_full_plans_on_random_graphs(
        (layers, reads, micro_batches) in layers(),
        executor in prop_oneof![Just(Executor::Graph), Just(Executor::Eager)],
    ) {
        let graph = random_graph(&layers, &reads, micro_batches, true);
        let config = PlanConfig { executor, ..PlanConfig::default() };
        assert_composes("random", &graph, &config, 8);
    }

    /// Backward in any order: a replay may read a copy another layer's replay made, which
    /// couples the layers; the model then says it is inexact, and otherwise is exact.
    #[test]
    fn the_composition_is_exact_or_says_it_is_not(
        (layers, reads, micro_batches) in layers(),
        executor in prop_oneof![Just(Executor::Graph), Just(Executor::Eager)],
    ) {
        let graph = random_graph(&layers, &reads, micro_batches, false);
        let config = PlanConfig { executor, ..PlanConfig::default() };
        let hw = HwProfile::default();
        let search = Search::new(&graph, &config, &hw).unwrap();
        if search.exact() {
            compare("random order", &graph, &config, &search, 8);
        }
    }
}
