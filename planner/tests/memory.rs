//! The liveness simulation pinned on hand-built graphs. Every value is a `[4, 4]` float32
//! tensor: 64 bytes.

use ir::{
    plan::{Code, Executor, Keep, Level, Peak, Stage},
    Graph,
};
use planner::{config::PlanConfig, cost::HwProfile, memory::simulate, plan::plan};
use testkit::Builder;

const ATTN: (&str, &[(&str, &str)]) = ("SAVE_ATTN", &[("attn.begin", "attn.end")]);

fn node_name(graph: &Graph, peak: Option<Peak>) -> Option<(Stage, String)> {
    peak.map(|p| (p.stage, graph.node(p.node).name.to_string()))
}

fn names(graph: &Graph, nodes: &[ir::NodeId]) -> Vec<String> {
    nodes
        .iter()
        .map(|&n| graph.node(n).name.to_string())
        .collect()
}

/// x -> a -> b -> c in layer 0; backward: g1 = c * t, g2 = a * g1.
fn chain() -> Builder {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1
    let bb = b.op(&a); // n2
    let c = b.op(&bb); // n3
    b.layer(None);
    let t = b.tangent("t");
    b.backward();
    let g1 = b.node("aten.mul.Tensor", &[&c, &t]).1; // n4
    let g2 = b.node("aten.mul.Tensor", &[&a, &g1]).1; // n5
    b.output(&g2);
    b
}

#[test]
fn m1_no_checkpointing_keeps_what_backward_reads_alive() {
    let graph = chain().build();
    let sim = simulate(&graph, graph.backward_order(), &[], &[]);
    // At n3: t, a (read by backward), b (read by n3) and c = 4 × 64.
    assert_eq!(sim.peak_bytes, 256);
    assert_eq!(
        node_name(&graph, sim.peak),
        Some((Stage::Forward, "n3".into()))
    );
    assert_eq!(sim.gradient_bytes, 64);
}

#[test]
fn m1_replay_is_materialised_just_before_its_first_backward_use() {
    let graph = chain().build();
    let p = plan(&graph, &PlanConfig::default(), &HwProfile::default()).unwrap();
    assert_eq!(names(&graph, &p.replay[0].nodes), vec!["n1", "n2", "n3"]);
    assert_eq!(
        graph.node(p.replay[0].before).name,
        "n4",
        "the replay runs right before backward reads c"
    );
    // Forward frees a, b, c early (only x, the layer input, is kept); replay rebuilds them:
    // at replayed n3, t, a', b', c' are live: 256 again, now in replay.
    assert_eq!(p.memory.peak_bytes, Some(256));
    assert_eq!(p.memory.peak.map(|p| p.stage), Some(Stage::Forward));
    assert_eq!(p.memory.full_recompute_peak_bytes, Some(256));
    assert_eq!(p.memory.no_checkpoint_peak_bytes, Some(256));
}

#[test]
fn m1_views_alias_their_base_and_cost_nothing() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1
    let v1 = b.node("aten.view.default", &[&a]).1; // n2
    let v2 = b.node("aten.view.default", &[&a]).1; // n3
    let c = b.node("aten.add.Tensor", &[&v1, &v2]).1; // n4
    b.output(&c);
    let graph = b.build();
    // Views share a's storage: x + a, then a + c. Were views storages of their own, n3 would
    // see a, v1 and v2 live (192).
    assert_eq!(
        simulate(&graph, graph.backward_order(), &[], &[]).peak_bytes,
        128
    );
}

/// Two layers of three ops; backward reads every forward value, last layer first.
fn deep() -> Graph {
    let mut b = Builder::new(2, &[ATTN]);
    let x = b.input("x");
    let mut h = x;
    let mut reads = Vec::new();
    for l in 0..2 {
        b.layer(Some(l));
        let m = b.marker("attn.begin", &h);
        let a = b.op(&m);
        let e = b.marker("attn.end", &a);
        let c = b.op(&e);
        h = b.op(&c);
        reads.extend([a, c, h.clone()]);
    }
    b.layer(None);
    reads.reverse();
    b.backward_through("t", &reads);
    b.build()
}

#[test]
fn m1_checkpointing_lowers_the_peak_and_keeping_sits_between_the_baselines() {
    let graph = deep();
    let hw = HwProfile::default();
    let none = plan(&graph, &PlanConfig::default(), &hw).unwrap();
    let all = plan(
        &graph,
        &PlanConfig {
            keep: Keep::All,
            ..PlanConfig::default()
        },
        &hw,
    )
    .unwrap();
    let no_ckpt = none.memory.no_checkpoint_peak_bytes.unwrap();
    let whole = none.memory.full_recompute_peak_bytes.unwrap();
    assert_eq!(
        none.memory.peak_bytes,
        Some(whole),
        "keeping nothing is whole-layer recompute"
    );
    assert!(whole < no_ckpt, "{whole} < {no_ckpt}");
    let kept = all.memory.peak_bytes.unwrap();
    assert!(
        whole <= kept && kept <= no_ckpt,
        "{whole} <= {kept} <= {no_ckpt}"
    );
    assert!(all.cost.replay_time_s < none.cost.replay_time_s);
    assert_eq!(
        none.cost.replay_time_s,
        none.cost.full_recompute_replay_time_s
    );
    assert!(all.units[0].replay_time_avoided_s > 0.0);
}

#[test]
fn m1_saved_bytes_count_each_activation_storage_once_and_no_views_of_inputs() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    let w = b.param("w");
    let wt = b.node("aten.t.default", &[&w]).1; // n1: a view of a weight, outside layers
    let a = b.node("aten.mm.default", &[&x, &wt]).1; // n2: 64 B, outside layers
    let at = b.node("aten.t.default", &[&a]).1; // n3: a view of n2
    b.layer(Some(0));
    let l = b.op(&a); // n4
    b.layer(None);
    b.backward_through("t", &[&wt, &a, &at, &l]);
    let graph = b.build();
    let p = plan(&graph, &PlanConfig::default(), &HwProfile::default()).unwrap();
    let saved: Vec<(String, Option<String>)> = p
        .saved
        .iter()
        .map(|s| {
            let name = |v: ir::ValueId| graph.value(v).name.to_string();
            (name(s.value), s.alias_of.map(name))
        })
        .collect();
    assert!(
        saved.contains(&("v1".into(), Some("w".into()))),
        "{saved:?}"
    );
    assert!(
        saved.contains(&("v3".into(), Some("v2".into()))),
        "{saved:?}"
    );
    // n2's 64 bytes, once: its view shares them, and the weight's view is no activation.
    assert_eq!(p.memory.saved_bytes, 64);
}

/// Every joint golden, planned with `keep` by `executor`.
fn golden_plans(executor: Executor, keep: Keep) -> Vec<(String, ir::plan::Plan)> {
    let dir = testkit::golden::repo_root().join("tests/golden");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pb"))
        .collect();
    paths.sort();
    let config = PlanConfig {
        keep,
        executor,
        ..PlanConfig::default()
    };
    paths
        .into_iter()
        .filter_map(|path| {
            let graph = ir::io::load(&path).unwrap();
            let joint = planner::partition::is_joint(&graph);
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            joint.then(|| (name, plan(&graph, &config, &HwProfile::default()).unwrap()))
        })
        .collect()
}

/// Everything saved is alive when forward ends, so no step holds less. Under the eager
/// executor this needs the checkpoint cache modelled: a kept output nothing reads after
/// forward is still held until its layer recomputes (dense, `--keep all`: 55,108 B saved).
#[test]
fn m1_the_peak_is_never_below_the_saved_set() {
    for executor in [Executor::Graph, Executor::Eager] {
        for keep in [Keep::Nothing, Keep::All] {
            for (name, p) in golden_plans(executor, keep.clone()) {
                let (peak, saved) = (p.memory.peak_bytes.unwrap(), p.memory.saved_bytes);
                assert!(
                    peak >= saved,
                    "{name}, {executor:?}, {keep:?}: peak {peak} B < saved {saved} B"
                );
            }
        }
    }
}

/// Eager `--keep all` on dense caches every kept op's outputs until its layer recomputes and
/// peaks above the step without checkpointing: the plan says so, with why; keeping nothing,
/// or the same keep under a graph executor, is no worse than not checkpointing.
#[test]
fn m1_eager_checkpointing_worse_than_none_is_a_warning() {
    let warned = |executor: Executor, keep: Keep| -> Vec<(String, u64, u64)> {
        golden_plans(executor, keep)
            .into_iter()
            .filter(|(_, p)| {
                p.diagnostics
                    .iter()
                    .any(|d| d.code == Code::EagerCheckpointCostsMemory)
            })
            .map(|(name, p)| {
                let m = &p.memory;
                (
                    name,
                    m.peak_bytes.unwrap(),
                    m.no_checkpoint_peak_bytes.unwrap(),
                )
            })
            .collect()
    };
    let eager_all = warned(Executor::Eager, Keep::All);
    assert!(
        eager_all.iter().any(|(name, _, _)| name == "dense"),
        "{eager_all:?}"
    );
    assert!(eager_all.iter().all(|&(_, peak, none)| peak > none));
    for (name, p) in golden_plans(Executor::Eager, Keep::All) {
        let m = &p.memory;
        let worse = m.peak_bytes > m.no_checkpoint_peak_bytes;
        assert_eq!(eager_all.iter().any(|w| w.0 == name), worse, "{name}");
    }
    assert_eq!(warned(Executor::Eager, Keep::Nothing), vec![]);
    assert_eq!(warned(Executor::Graph, Keep::All), vec![]);
    let dense = golden_plans(Executor::Eager, Keep::All)
        .into_iter()
        .find(|(name, _)| name == "dense")
        .unwrap()
        .1;
    let d = dense
        .diagnostics
        .iter()
        .find(|d| d.code == Code::EagerCheckpointCostsMemory)
        .unwrap();
    assert_eq!(d.level, Level::Warning);
    assert!(
        d.message.contains("selective-checkpoint cache"),
        "{}",
        d.message
    );
}

/// x -> a -> [marker] -> h -> o in layer 0 (`marked`: with the marker, else `h` reads `a`);
/// backward reads `o`, the marker's output (or `a`) and `a`.
fn marked_chain(marked: bool) -> Graph {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x);
    let m = if marked {
        b.marker("attn.end", &a)
    } else {
        a.clone()
    };
    let h = b.op(&m);
    let o = b.op(&h);
    b.layer(None);
    b.backward_through("t", &[o, m, a]);
    b.build()
}

#[test]
fn eager_runs_no_marker_op_so_a_markers_output_is_its_input() {
    use planner::memory::{simulate_executed, Executed};
    let eager = Executed {
        markers_alias: true,
        ..Executed::default()
    };
    let peak = |graph: &Graph, executed: Executed<'_>| {
        simulate_executed(graph, graph.backward_order(), &[], executed).peak_bytes
    };
    let marked = marked_chain(true);
    let unmarked = marked_chain(false);
    // Eager: the step as if the marker were not there.
    assert_eq!(peak(&marked, eager), peak(&unmarked, eager));
    // A graph executor runs the marker as the copy the graph says it makes: the copy and its
    // input are both saved for backward.
    assert_eq!(
        peak(&marked, Executed::default()),
        peak(&unmarked, Executed::default()) + 64
    );
    let partition = |executor| {
        let config = PlanConfig {
            executor,
            ..PlanConfig::default()
        };
        let resolved = planner::config::resolve(&marked, &config).unwrap();
        let policy = planner::policy::apply(&marked, &config, &resolved);
        planner::partition::partition(&marked, &policy, executor)
    };
    assert!(partition(Executor::Eager).executed().markers_alias);
    assert!(!partition(Executor::Graph).executed().markers_alias);
    assert!(partition(Executor::Compiled).executed().markers_alias);
}

#[test]
fn the_compiled_executor_holds_no_marker_copy_the_graph_executor_holds() {
    // The compile stage removes the markers from its graphs once planned: without
    // checkpointing, its step is the unmarked one, where the runtime also holds the copy.
    let no_checkpoint = |graph: &Graph, executor| {
        let config = PlanConfig {
            executor,
            ..PlanConfig::default()
        };
        plan(graph, &config, &HwProfile::default())
            .unwrap()
            .memory
            .no_checkpoint_peak_bytes
            .unwrap()
    };
    let (marked, unmarked) = (marked_chain(true), marked_chain(false));
    let graph_executor = no_checkpoint(&marked, Executor::Graph);
    assert_eq!(
        graph_executor,
        no_checkpoint(&unmarked, Executor::Graph) + 64
    );
    assert_eq!(
        no_checkpoint(&marked, Executor::Compiled),
        no_checkpoint(&unmarked, Executor::Compiled)
    );
    assert_eq!(
        no_checkpoint(&marked, Executor::Compiled),
        graph_executor - 64
    );
}
