//! Offload (docs/cost-and-memory.md, M5): where an offloaded storage leaves the device and
//! comes back, what the device peak and the host hold, and the storages kept on the device.
//! Hand-built graphs hold `[4, 4]` float32 tensors: 64 bytes each.

use ir::{
    plan::{Code, Executor, Keep, Level, Offload, Plan, SavedKind},
    Graph, ValueId,
};
use planner::{
    config::PlanConfig,
    cost::HwProfile,
    memory::{self, simulate_offloaded, OffloadRequest, OffloadWindow},
    offload::copy_seconds,
    plan::plan,
};
use testkit::Builder;

/// Forward: a = op(x) (step 0), c = op(a) (1). Backward: g1 = neg(c) (2), g2 = g1 * g1 (3),
/// g3 = g2 * g1 (4), g4 = a * g3 (5). Without offload the peak is a, g1, g2, g3 at step 4.
fn late_read() -> (Graph, ValueId) {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    let a = b.op(&x);
    let c = b.op(&a);
    b.backward();
    let g1 = b.node("aten.neg.default", &[&c]).1;
    let g2 = b.node("aten.mul.Tensor", &[&g1, &g1]).1;
    let g3 = b.node("aten.mul.Tensor", &[&g2, &g1]).1;
    let g4 = b.node("aten.mul.Tensor", &[&a, &g3]).1;
    b.output(&g4);
    let graph = b.build();
    let a = graph
        .values()
        .iter()
        .find(|(_, v)| v.name == a)
        .map(|(id, _)| id)
        .expect("a exists");
    (graph, a)
}

fn offloaded(graph: &Graph, values: &[ValueId], prefetch: usize) -> (u64, Vec<OffloadWindow>) {
    offloaded_copying(graph, values, prefetch, false)
}

/// [`offloaded`] by an executor that copies a storage when it is first saved, or not.
fn offloaded_copying(
    graph: &Graph,
    values: &[ValueId],
    prefetch: usize,
    copied_at_save: bool,
) -> (u64, Vec<OffloadWindow>) {
    let (sim, windows) = simulate_offloaded(
        graph,
        graph.backward_order(),
        &[],
        memory::Executed::default(),
        1,
        OffloadRequest {
            values,
            prefetch,
            copied_at_save,
        },
    );
    (sim.peak_bytes, windows)
}

#[test]
fn m5_an_offloaded_value_is_off_the_device_from_its_copy_to_its_reload() {
    let (graph, a) = late_read();
    let (without, _) = offloaded(&graph, &[], 0);
    assert_eq!(without, 256);
    let (with, windows) = offloaded(&graph, &[a], 0);
    // `a` lives through step 2 (its copy runs beside the step after its last forward read)
    // and again from step 5, its first backward read: the peak of 4 values at step 4 loses it.
    assert_eq!(with, 192);
    assert_eq!(
        windows,
        vec![OffloadWindow {
            value: a,
            bytes: 64,
            last_forward_read: 1,
            held_until: 1,
            first_backward_read: Some(5),
            reload_at: Some(5),
            moved: true,
        }]
    );
}

#[test]
fn m5_a_copy_made_when_saved_frees_the_device_after_the_last_forward_read() {
    let (graph, a) = late_read();
    // Reloaded at step 3: the graph executor's copy holds `a` through step 2, so the device is
    // never free of it; eager copied it when it was saved, so it is free of it at step 2.
    let (_, graph_copy) = offloaded_copying(&graph, &[a], 2, false);
    let (_, eager_copy) = offloaded_copying(&graph, &[a], 2, true);
    assert_eq!(graph_copy[0].reload_at, Some(3));
    assert!(!graph_copy[0].moved);
    assert_eq!(eager_copy[0].reload_at, Some(3));
    assert!(eager_copy[0].moved);
}

#[test]
fn m5_the_reload_comes_prefetch_steps_before_the_first_backward_read() {
    let (graph, a) = late_read();
    let (with, windows) = offloaded(&graph, &[a], 1);
    // Reloaded at step 4, `a` is back on the device for the peak at step 4.
    assert_eq!(windows[0].reload_at, Some(4));
    assert!(windows[0].moved);
    assert_eq!(with, 256);
}

#[test]
fn m5_a_value_the_device_is_never_free_of_stays_on_the_device() {
    let (graph, a) = late_read();
    // A reload 3 steps ahead starts with backward, right after the copy: no step without it.
    let (with, windows) = offloaded(&graph, &[a], 3);
    assert_eq!(windows[0].reload_at, Some(2));
    assert!(!windows[0].moved);
    assert_eq!(with, 256);
}

fn offload_config(keep: Keep, kinds: &[SavedKind], executor: Executor) -> PlanConfig {
    PlanConfig {
        keep,
        executor,
        offload: Offload {
            kinds: kinds.to_vec(),
            ..Offload::default()
        },
        ..PlanConfig::default()
    }
}

fn golden(name: &str) -> Graph {
    let path = format!("{}/../tests/golden/{name}.pb", env!("CARGO_MANIFEST_DIR"));
    ir::io::load(std::path::Path::new(&path)).expect("golden loads")
}

const GOLDENS: &[&str] = &[
    "dense",
    "glm_dsa_ep2",
    "moe_ep2",
    "moe_ep2_inplace",
    "dense_dropout",
];

/// The offloaded storages' bytes, each once.
fn offloaded_root_bytes(graph: &Graph, plan: &Plan) -> u64 {
    let mut roots: Vec<ValueId> = plan
        .saved
        .iter()
        .filter(|s| s.offloaded)
        .map(|s| graph.storage_root(s.value))
        .collect();
    roots.sort_unstable();
    roots.dedup();
    roots.iter().map(|&r| graph.value(r).bytes).sum()
}

#[test]
fn m5_offload_never_raises_the_device_peak_and_the_host_holds_every_moved_byte() {
    let hw = HwProfile::default();
    let kinds = [
        SavedKind::Kept,
        SavedKind::LayerInput,
        SavedKind::NotCheckpointed,
    ];
    for name in GOLDENS {
        let graph = golden(name);
        for executor in [Executor::Graph, Executor::Eager] {
            let without = plan(&graph, &offload_config(Keep::All, &[], executor), &hw).unwrap();
            let with = plan(&graph, &offload_config(Keep::All, &kinds, executor), &hw).unwrap();
            let (before, after) = (without.memory.peak_bytes, with.memory.peak_bytes);
            assert!(after <= before, "{name} {executor}: {after:?} > {before:?}");
            // Every copy leaves forward before every reload: all moved bytes are on the host
            // at once, after forward.
            let moved = offloaded_root_bytes(&graph, &with);
            assert_eq!(with.memory.offloaded_bytes, moved, "{name} {executor}");
            assert_eq!(with.memory.host_peak_bytes, moved, "{name} {executor}");
            assert_eq!(without.memory.offloaded_bytes, 0);
            // On the device when forward ends: the saved set less what has left it.
            let m = &with.memory;
            let on_device = m.saved_on_device_bytes;
            assert!(m.saved_bytes - moved <= on_device && on_device <= m.saved_bytes);
            assert_eq!(
                without.memory.saved_on_device_bytes,
                without.memory.saved_bytes
            );
            let exposed = with.cost.exposed_transfer_time_s;
            assert!(exposed <= with.cost.transfer_time_s, "{name} {executor}");
            assert_eq!(
                with.cost.step_time_s,
                with.cost.forward_time_s
                    + with.cost.replay_time_s
                    + with.cost.backward_time_s
                    + exposed
            );
        }
    }
}

#[test]
fn m5_every_reload_lands_before_the_first_backward_read_and_after_forward() {
    let graph = golden("glm_dsa_ep2");
    let hw = HwProfile::default();
    let config = offload_config(
        Keep::All,
        &[SavedKind::Kept, SavedKind::LayerInput],
        Executor::Graph,
    );
    let resolved = planner::config::resolve(&graph, &config).unwrap();
    let policy = planner::policy::apply(&graph, &config, &resolved);
    let partition = planner::partition::partition(&graph, &policy, config.executor);
    let selection = planner::offload::select(&graph, &config, &resolved, &policy, &partition);
    assert!(!selection.roots.is_empty());
    let (_, windows) = simulate_offloaded(
        &graph,
        &partition.order,
        &partition.replays,
        partition.executed(),
        1,
        OffloadRequest {
            values: &selection.roots,
            prefetch: 4,
            copied_at_save: planner::offload::copied_at_save(config.executor),
        },
    );
    let forward_steps = memory::forward_step_count(&graph);
    for w in windows.iter().filter(|w| w.moved) {
        let first = w
            .first_backward_read
            .expect("a moved value is read after forward");
        let reload_at = w.reload_at.expect("a value read after forward is reloaded");
        assert!(reload_at <= first && reload_at >= forward_steps, "{w:?}");
        assert!(reload_at >= first.saturating_sub(4), "{w:?}");
        assert!(w.last_forward_read + 2 <= reload_at, "{w:?}");
    }
    let planned = plan(&graph, &config, &hw).unwrap();
    assert!(planned.memory.offloaded_bytes > 0);
}

fn codes(plan: &Plan) -> Vec<Code> {
    plan.diagnostics.iter().map(|d| d.code).collect()
}

#[test]
fn m5_a_storage_written_in_place_stays_on_the_device() {
    // Outside layers: a = op(x), then written in place; backward reads the written tensor.
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    let a = b.op(&x);
    let written = b.node("aten.add_.Tensor", &[&a, &x]).1;
    let t = b.tangent("t");
    b.backward();
    let g = b.node("aten.mul.Tensor", &[&written, &t]).1;
    b.output(&g);
    let graph = b.build();
    let config = offload_config(
        Keep::Nothing,
        &[SavedKind::NotCheckpointed],
        Executor::Graph,
    );
    let p = plan(&graph, &config, &HwProfile::default()).unwrap();
    assert!(
        codes(&p).contains(&Code::OffloadWrittenInPlace),
        "{:?}",
        p.diagnostics
    );
    assert!(p.saved.iter().all(|s| !s.offloaded));
    assert_eq!(p.memory.offloaded_bytes, 0);
}

const ATTN: (&str, &[(&str, &str)]) = ("SAVE_ATTN", &[("attn.begin", "attn.end")]);

#[test]
fn m5_a_storage_another_saved_value_views_on_the_device_stays_there() {
    // Layer 0: SAVE_ATTN keeps `a`; between the layers a view of it is made, layer 1's
    // input, saved for layer 1's replay. Offloading what SAVE_ATTN keeps would leave the view
    // on the device over the same storage.
    let mut b = Builder::new(2, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let m = b.marker("attn.begin", &x);
    let a = b.op(&m);
    let e = b.marker("attn.end", &a);
    let h = b.op(&e);
    b.layer(None);
    let view = b.node("aten.view.default", &[&a]).1;
    b.layer(Some(1));
    let c = b.op(&view);
    b.layer(None);
    b.backward_through("t", &[c, h, a]);
    let graph = b.build();
    let config = PlanConfig {
        keep: Keep::Units(vec!["SAVE_ATTN".into()]),
        offload: Offload {
            units: vec!["SAVE_ATTN".into()],
            ..Offload::default()
        },
        ..PlanConfig::default()
    };
    let p = plan(&graph, &config, &HwProfile::default()).unwrap();
    assert!(
        codes(&p).contains(&Code::OffloadAliasedOnDevice),
        "{:?} {:?}",
        p.diagnostics,
        p.saved
    );
    assert_eq!(p.memory.offloaded_bytes, 0);
}

#[test]
fn m5_copies_are_exposed_in_full_without_a_device_queue_and_cost_no_host_sync() {
    let graph = golden("glm_dsa_ep2");
    let config = PlanConfig {
        keep: Keep::Units(vec!["SAVE_DSA_INDEXER".into()]),
        offload: Offload {
            units: vec!["SAVE_DSA_INDEXER".into()],
            ..Offload::default()
        },
        ..PlanConfig::default()
    };
    let gpu = HwProfile::default();
    let p = plan(&graph, &config, &gpu).unwrap();
    // Each moved storage is copied twice: bytes over the host link plus a launch, no sync.
    let copies = 2.0 * p.memory.offloaded_bytes as f64 / gpu.host_bytes_per_s;
    let moved = p.saved.iter().filter(|s| s.offloaded).count() as f64;
    let expected = copies + 2.0 * moved * gpu.op_overhead_s;
    assert!((p.cost.transfer_time_s - expected).abs() < 1e-12 * expected.max(1.0));
    assert!(p.cost.exposed_transfer_time_s < p.cost.transfer_time_s);
    let cpu = HwProfile {
        asynchronous: false,
        ..gpu
    };
    let p = plan(&graph, &config, &cpu).unwrap();
    assert_eq!(p.cost.exposed_transfer_time_s, p.cost.transfer_time_s);
}

#[test]
fn m5_the_budget_search_refuses_offload_rather_than_compose_it_wrongly() {
    let graph = golden("glm_dsa_ep2");
    let hw = HwProfile::default();
    let config = offload_config(Keep::Nothing, &[SavedKind::LayerInput], Executor::Graph);
    assert!(matches!(
        planner::budget::Search::new(&graph, &config, &hw),
        Err(planner::budget::BudgetError::Offload)
    ));
}

#[test]
fn m5_a_host_peak_above_the_profiles_host_memory_rejects_the_plan() {
    let graph = golden("glm_dsa_ep2");
    let kinds = [SavedKind::Kept, SavedKind::LayerInput];
    let config = offload_config(Keep::All, &kinds, Executor::Graph);
    let roomy = HwProfile::default();
    let fits = plan(&graph, &config, &roomy).unwrap();
    let host_peak = fits.memory.host_peak_bytes;
    assert!(host_peak > 0);
    assert_eq!(
        fits.memory.host_memory_bytes,
        roomy.host_memory_bytes as u64
    );
    assert!(!codes(&fits).contains(&Code::OffloadExceedsHostMemory));
    // One byte short of the host peak: the same plan no longer fits the host.
    let tight = HwProfile {
        host_memory_bytes: (host_peak - 1) as f64,
        ..HwProfile::default()
    };
    let over = plan(&graph, &config, &tight).unwrap();
    let found: Vec<_> = over
        .diagnostics
        .iter()
        .filter(|d| d.code == Code::OffloadExceedsHostMemory)
        .collect();
    assert_eq!(found.len(), 1, "{:?}", over.diagnostics);
    assert_eq!(found[0].level, Level::Error);
    assert!(found[0].message.contains(&host_peak.to_string()));
}

const SAVE_A: (&str, &[(&str, &str)]) = ("SAVE_A", &[("a.begin", "a.end")]);
const SAVE_B: (&str, &[(&str, &str)]) = ("SAVE_B", &[("b.begin", "b.end")]);

/// The plan of `graph` under eager SAC keeping and offloading `units`, each reload at its
/// first read (`--offload-prefetch 0`), and the windows of the offloaded storages.
fn eager_offloaded(graph: &Graph, units: &[&str]) -> (Plan, Vec<OffloadWindow>) {
    let units: Vec<String> = units.iter().map(|u| u.to_string()).collect();
    let config = PlanConfig {
        keep: Keep::Units(units.clone()),
        executor: Executor::Eager,
        offload: Offload {
            units,
            prefetch: 0,
            ..Offload::default()
        },
        ..PlanConfig::default()
    };
    let resolved = planner::config::resolve(graph, &config).unwrap();
    let policy = planner::policy::apply(graph, &config, &resolved);
    let partition = planner::partition::partition(graph, &policy, config.executor);
    let selection = planner::offload::select(graph, &config, &resolved, &policy, &partition);
    let (_, windows) = simulate_offloaded(
        graph,
        &partition.order,
        &partition.replays,
        partition.executed(),
        1,
        OffloadRequest {
            values: &selection.roots,
            prefetch: 0,
            copied_at_save: planner::offload::copied_at_save(config.executor),
        },
    );
    (
        plan(graph, &config, &HwProfile::default()).unwrap(),
        windows,
    )
}

/// One layer: p1 = op(x), p2 = op(p1), p3 = op(p2), then SAVE_A keeps a1 = op(p3) and
/// a2 = op(a1), and h = op(a2). Backward reads p1, p2, p3 only: the recompute stops at p3,
/// never reaching the kept ops.
fn unreached_kept_ops() -> Graph {
    let mut b = Builder::new(1, &[SAVE_A]);
    let x = b.input("x");
    b.layer(Some(0));
    let p1 = b.op(&x);
    let p2 = b.op(&p1);
    let p3 = b.op(&p2);
    let m = b.marker("a.begin", &p3);
    let a1 = b.op(&m);
    let a2 = b.op(&a1);
    let e = b.marker("a.end", &a2);
    b.op(&e);
    b.layer(None);
    b.backward_through("t", &[p1, p2, p3]);
    b.build()
}

#[test]
fn m5_eager_a_kept_output_the_recompute_never_reaches_is_copied_to_the_host_and_never_reloaded() {
    let (p, windows) = eager_offloaded(&unreached_kept_ops(), &["SAVE_A"]);
    for w in &windows {
        assert!(w.moved, "{w:?}");
        assert_eq!((w.first_backward_read, w.reload_at), (None, None), "{w:?}");
    }
    // The cache holds both host copies until the recompute returns.
    assert_eq!(windows.len(), 2);
    assert_eq!(p.memory.offloaded_bytes, 128);
    assert_eq!(p.memory.host_peak_bytes, 128);
    // Both leave the device in forward: the cache copied them as forward made them, so a2,
    // which the last forward op reads through the end marker, goes once that op has run.
    assert_eq!(p.memory.saved_on_device_bytes, p.memory.saved_bytes - 128);
    // The peak is backward's first op: x (the frame), t, the replayed p1, p2, p3 and its
    // gradient. Reloading a1 and a2 as the recompute returns would make it 448 B there.
    assert_eq!(p.memory.peak_bytes, Some(384));
}

#[test]
fn m5_eager_a_storage_copied_to_the_host_and_never_reloaded_costs_one_copy() {
    let (p, windows) = eager_offloaded(&unreached_kept_ops(), &["SAVE_A"]);
    assert!(windows.iter().all(|w| w.moved && w.reload_at.is_none()));
    let hw = HwProfile::default();
    let expected = 2.0 * copy_seconds(&hw, 64);
    assert!(
        (p.cost.transfer_time_s - expected).abs() < 1e-15,
        "{} {expected}",
        p.cost.transfer_time_s
    );
}

#[test]
fn m5_eager_kept_outputs_come_back_one_at_a_time_as_the_recompute_reaches_them() {
    // One layer: r0 = op(x); SAVE_A keeps k1 = op(r0), read by the SAVE_B begin marker; SAVE_B
    // keeps z = op(r0) and k2 = op(z); r2 = op(k2), which backward reads. k1 and k2 are
    // 1,024 B, the rest 64 B. The recompute reads k1 last at the SAVE_B begin marker, the
    // replayed node before z and k2, and reaches k2 only after it.
    let mut b = Builder::new(1, &[SAVE_A, SAVE_B]);
    let x = b.input("x");
    b.layer(Some(0));
    let r0 = b.op(&x);
    let m = b.marker("a.begin", &r0);
    let k1 = b.op(&m);
    let e = b.marker("a.end", &k1);
    b.marker("b.begin", &e);
    let z = b.op(&r0);
    let k2 = b.op(&z);
    let e = b.marker("b.end", &k2);
    let r2 = b.op(&e);
    b.layer(None);
    b.backward_through("t", &[r2]);
    let mut wire = b.wire();
    for v in wire
        .values
        .iter_mut()
        .filter(|v| v.name == k1 || v.name == k2)
    {
        v.shape = vec![16, 16];
    }
    let graph = Graph::from_wire(wire).unwrap();
    let (p, windows) = eager_offloaded(&graph, &["SAVE_A", "SAVE_B"]);
    let big: Vec<&OffloadWindow> = windows.iter().filter(|w| w.bytes == 1024).collect();
    assert_eq!(big.len(), 2);
    assert!(
        big.iter().all(|w| w.moved && w.reload_at.is_some()),
        "{big:?}"
    );
    // k2 comes back after the marker that reads k1 last: the device holds one 1,024 B reload
    // at a time. Reloaded at the marker, k2 would meet k1 there (2,048 B and more).
    assert!(
        big[1].reload_at > big[0].reload_at.map(|r| r + 1),
        "{big:?}"
    );
    // The peak holds one 1,024 B reload and three 64 B values (four if the copies held their
    // storages a step past their last forward read, as the graph executor's do).
    assert_eq!(p.memory.peak_bytes, Some(1024 + 3 * 64));
}

#[test]
fn m5_eager_a_checkpoint_input_the_cache_also_holds_stays_on_the_device_through_the_frame() {
    // Layer 0: r0 = op(x), SAVE_A keeps k = op(r0), then q = op(k). Layer 1 reads k: r1 =
    // op(k), r2 = op(r1). Backward reads r2, r1 (layer 1), then q (layer 0's recompute, which
    // takes k back from the cache).
    let mut b = Builder::new(2, &[SAVE_A]);
    let x = b.input("x");
    b.layer(Some(0));
    let r0 = b.op(&x);
    let m = b.marker("a.begin", &r0);
    let k = b.op(&m);
    let e = b.marker("a.end", &k);
    let q = b.op(&e);
    b.layer(Some(1));
    let r1 = b.op(&e);
    let r2 = b.op(&r1);
    b.layer(None);
    b.backward_through("t", &[r2, r1, q]);
    let graph = b.build();
    let (p, windows) = eager_offloaded(&graph, &["SAVE_A"]);
    let [w] = windows.as_slice() else {
        panic!("{windows:?}")
    };
    // Layer 1's frame holds k's device tensor until layer 1's last backward read (step 10):
    // the cache's host copy frees nothing before. Layer 0's recompute reloads it after.
    assert_eq!((w.last_forward_read, w.held_until), (5, 10), "{w:?}");
    assert!(w.moved && w.reload_at > Some(w.held_until + 1), "{w:?}");
    // k is on the device at backward's first op, as without offload: x, t, k, the replayed
    // r1 and r2, and the gradient.
    assert_eq!(p.memory.peak_bytes, Some(384));
    // When forward ends, k is offloaded yet still on the device.
    assert_eq!(p.memory.offloaded_bytes, w.bytes);
    assert_eq!(p.memory.saved_on_device_bytes, p.memory.saved_bytes);
}

#[test]
fn m5_eager_a_kept_output_a_never_recomputed_layers_frame_holds_to_the_end_stays_on_the_device() {
    // Layer 0 keeps k and makes q = op(k); layer 1 reads k (r1 = op(k)), but backward reads
    // nothing of layer 1, so its frame holds k's device tensor to the end of the step: the
    // device is never free of k, which stays (and planning does not run past the last step).
    let mut b = Builder::new(2, &[SAVE_A]);
    let x = b.input("x");
    b.layer(Some(0));
    let r0 = b.op(&x);
    let m = b.marker("a.begin", &r0);
    let k = b.op(&m);
    let e = b.marker("a.end", &k);
    let q = b.op(&e);
    b.layer(Some(1));
    b.op(&e);
    b.layer(None);
    b.backward_through("t", &[q]);
    let graph = b.build();
    let (p, windows) = eager_offloaded(&graph, &["SAVE_A"]);
    assert!(windows.iter().all(|w| !w.moved), "{windows:?}");
    assert_eq!(p.memory.offloaded_bytes, 0);
    assert_eq!(p.memory.saved_on_device_bytes, p.memory.saved_bytes);
}
