//! Property tests on random joint graphs with random markers, compiled regions, views, mutable
//! ops and collectives: the partition verifier always passes (plan() runs it), every kept op is
//! eager and non-mutable, and the output is deterministic.

use ir::plan::{Collectives, Decision, Executor, Format, Keep, RandomOps, Reason};
use planner::{config::PlanConfig, cost::HwProfile, plan::plan, render};
use proptest::prelude::*;
use testkit::Builder;

const UNITS: [(&str, &[(&str, &str)]); 2] = [
    ("SAVE_ATTN", &[("attn.begin", "attn.end")]),
    (
        "SAVE_MLP",
        &[("mlp.begin", "mlp.end"), ("mlp2.begin", "mlp2.end")],
    ),
];
const MARKERS: [&str; 6] = [
    "attn.begin",
    "attn.end",
    "mlp.begin",
    "mlp.end",
    "mlp2.begin",
    "mlp2.end",
];

#[derive(Debug, Clone)]
enum Step {
    Op(usize),
    View(usize),
    TopK(usize),
    Dropout(usize),
    Marker(usize, usize),
    InPlace(usize, usize),
    Functional(usize),
    Mutating(usize),
    ToggleRegion,
    MicroBatch,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => any::<usize>().prop_map(Step::Op),
        1 => any::<usize>().prop_map(Step::View),
        1 => any::<usize>().prop_map(Step::TopK),
        1 => any::<usize>().prop_map(Step::Dropout),
        3 => (0..MARKERS.len(), any::<usize>()).prop_map(|(m, x)| Step::Marker(m, x)),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Step::InPlace(a, b)),
        1 => any::<usize>().prop_map(Step::Functional),
        1 => any::<usize>().prop_map(Step::Mutating),
        1 => Just(Step::ToggleRegion),
        1 => Just(Step::MicroBatch),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    layers: Vec<Vec<Step>>,
    backward_reads: Vec<usize>,
    keep: Keep,
    ratio: f64,
    collectives: Collectives,
    random_ops: RandomOps,
    executor: Executor,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(prop::collection::vec(step(), 1..14), 1..4),
        prop::collection::vec(any::<usize>(), 1..12),
        prop_oneof![
            Just(Keep::Nothing),
            Just(Keep::All),
            Just(Keep::Units(vec!["SAVE_ATTN".into()])),
            Just(Keep::Units(vec!["SAVE_MLP".into()])),
        ],
        prop_oneof![Just(1.0), Just(0.5), Just(0.0)],
        prop_oneof![Just(Collectives::Recompute), Just(Collectives::Save)],
        prop_oneof![Just(RandomOps::Save), Just(RandomOps::Replay)],
        prop_oneof![Just(Executor::Graph), Just(Executor::Eager)],
    )
        .prop_map(
            |(layers, backward_reads, keep, ratio, collectives, random_ops, executor)| Case {
                layers,
                backward_reads,
                keep,
                ratio,
                collectives,
                random_ops,
                executor,
            },
        )
}

fn pick(pool: &[String], i: usize) -> &str {
    &pool[i % pool.len()]
}

/// Builds the case's graph: each layer's ops read earlier values of the layer (or its input).
fn build(case: &Case) -> ir::Graph {
    let mut b = Builder::new(case.layers.len() as u32, &UNITS);
    let x = b.input("x");
    let mut forward = vec![];
    let mut h = x;
    for (l, steps) in case.layers.iter().enumerate() {
        b.layer(Some(l as u32)).region("").micro_batch(0);
        let mut pool = vec![h.clone()];
        let mut compiled = false;
        for s in steps {
            let out = match *s {
                Step::Op(i) => b.op(pick(&pool, i)),
                Step::View(i) => b.node("aten.view.default", &[pick(&pool, i)]).1,
                Step::TopK(i) => b.node("aten.topk.default", &[pick(&pool, i)]).1,
                Step::Dropout(i) => b.node("aten.native_dropout.default", &[pick(&pool, i)]).1,
                Step::Marker(m, i) => b.marker(MARKERS[m], pick(&pool, i)),
                Step::InPlace(a, c) => {
                    let (target, src) = (pick(&pool, a).to_owned(), pick(&pool, c).to_owned());
                    b.node("aten.add_.Tensor", &[&target, &src]).1
                }
                Step::Functional(i) => {
                    let a2a = b
                        .node(
                            "_c10d_functional.all_to_all_single.default",
                            &[pick(&pool, i)],
                        )
                        .1;
                    b.node("_c10d_functional.wait_tensor.default", &[&a2a]).1
                }
                Step::Mutating(i) => {
                    let buf = b.node("aten.empty_like.default", &[pick(&pool, i)]).1;
                    b.node("c10d.alltoall_base_.default", &[&buf, pick(&pool, i)])
                        .1
                }
                Step::ToggleRegion => {
                    compiled = !compiled;
                    b.region(if compiled { "compiled" } else { "" });
                    continue;
                }
                Step::MicroBatch => {
                    b.micro_batch(1);
                    continue;
                }
            };
            pool.push(out);
        }
        h = b.op(pool.last().expect("the pool starts with the layer input"));
        forward.extend(pool.into_iter().skip(1));
        forward.push(h.clone());
    }
    b.layer(None).region("").micro_batch(0);
    let t = b.tangent("tangent");
    b.backward();
    let mut grad = b.node("aten.mul.Tensor", &[&h, &t]).1;
    for &i in &case.backward_reads {
        grad = b.node("aten.mul.Tensor", &[pick(&forward, i), &grad]).1;
    }
    b.output(&grad);
    b.build()
}

fn config(case: &Case) -> PlanConfig {
    PlanConfig {
        keep: case.keep.clone(),
        recompute_ratio: case.ratio,
        collectives: case.collectives,
        random_ops: case.random_ops,
        executor: case.executor,
        ..PlanConfig::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn the_partition_always_verifies(case in case()) {
        let graph = build(&case);
        let result = plan(&graph, &config(&case), &HwProfile::default());
        prop_assert!(result.is_ok(), "{}", result.err().map(|e| e.to_string()).unwrap_or_default());
    }

    #[test]
    fn every_kept_op_is_eager_and_not_mutable(case in case()) {
        let graph = build(&case);
        let p = plan(&graph, &config(&case), &HwProfile::default()).unwrap();
        for doc in p.nodes.iter().filter(|n| n.decision == Decision::Save) {
            let node = graph.node(doc.node);
            prop_assert!(node.compiled_region.is_none(), "{} kept in a compiled region", node.name);
            prop_assert!(!node.effects.is_mutable(), "{} kept though mutable", node.name);
            prop_assert!(node.marker().is_none(), "{} is a marker", node.name);
            prop_assert!(node.effects.view_of.is_none(), "{} is a view", node.name);
        }
        // A random op in a checkpointed layer is saved, or replays with its forward generator
        // state, and the plan says which: never a silent replay.
        for doc in p.nodes.iter().filter(|n| graph.node(n.node).draws_random()) {
            match doc.decision {
                Decision::Save => {
                    prop_assert_eq!(doc.reason, Reason::Random);
                    prop_assert_eq!(case.random_ops, RandomOps::Save);
                }
                Decision::Recompute => prop_assert_eq!(doc.reason, Reason::RandomReplayed),
                Decision::NoCheckpoint => {}
            }
        }
        if case.keep == Keep::Nothing
            && case.collectives == Collectives::Recompute
            && case.random_ops == RandomOps::Replay
        {
            prop_assert!(p.nodes.iter().all(|n| n.decision != Decision::Save));
        }
    }

    #[test]
    fn replay_holds_only_recomputed_ops(case in case()) {
        let graph = build(&case);
        let p = plan(&graph, &config(&case), &HwProfile::default()).unwrap();
        for replay in &p.replay {
            for &id in &replay.nodes {
                let doc = p.nodes.iter().find(|n| n.node == id).unwrap();
                prop_assert_eq!(doc.decision, Decision::Recompute);
            }
        }
    }

    #[test]
    fn output_is_deterministic(case in case()) {
        let (g1, g2) = (build(&case), build(&case));
        let one = plan(&g1, &config(&case), &HwProfile::default()).unwrap();
        let two = plan(&g2, &config(&case), &HwProfile::default()).unwrap();
        prop_assert_eq!(one.encode(&g1, Format::Json), two.encode(&g2, Format::Json));
        prop_assert_eq!(one.encode(&g1, Format::Protobuf), two.encode(&g2, Format::Protobuf));
        prop_assert_eq!(render::text(&one, &g1), render::text(&two, &g2));
    }
}
