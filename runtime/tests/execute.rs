//! One rank executing a step: every golden's ops run, unsupported ops are refused before
//! anything runs, the marker copies its input as eager PyTorch does, kernels that sum in no
//! fixed order run deterministically, replay (random ops included) reproduces forward
//! bit for bit, and memory is measured by storage.

mod common;

use std::path::Path;

use ir::{wire::graph as pb, Graph, NodeId, ValueId};
use runtime::{
    check,
    comm::loopback::LoopbackGroup,
    exec::{run_step, StepResult},
    ffi,
    inputs::{self, RankInputs},
    program::{PrepareError, Program},
    rng::RankRng,
    schedule::{ReplaySpec, Schedule, ScheduleError},
    Device,
};
use tch::Tensor;
use testkit::Builder;

fn node(graph: &Graph, name: &str) -> NodeId {
    graph
        .nodes()
        .iter()
        .find(|(_, n)| n.name == name)
        .map(|(id, _)| id)
        .expect("the node exists")
}

fn value(graph: &Graph, name: &str) -> ValueId {
    graph
        .values()
        .iter()
        .find(|(_, v)| v.name == name)
        .map(|(id, _)| id)
        .expect("the value exists")
}

fn seeded_inputs(graph: &Graph) -> RankInputs {
    inputs::load(
        graph,
        Path::new("/nonexistent.safetensors"),
        0,
        Some(3),
        Device::Cpu,
        u64::MAX,
    )
    .expect("seeded inputs")
}

/// Runs `schedule` on one rank from generator seed 11.
fn step(graph: &Graph, schedule: &Schedule, inputs: &RankInputs) -> StepResult {
    let program = Program::prepare(graph, Device::Cpu, 1).expect("every op runs");
    let mut comm = LoopbackGroup::new(1, std::time::Duration::from_secs(5)).rank(0);
    let mut rng = RankRng::seeded(Device::Cpu, 11).expect("a generator");
    run_step(&program, schedule, inputs, &mut comm, &mut rng, None).expect("the step runs")
}

fn random() -> Option<pb::SchemaFacts> {
    Some(pb::SchemaFacts {
        random: true,
        ..Default::default()
    })
}

fn view_of_input_0() -> Option<pb::SchemaFacts> {
    Some(pb::SchemaFacts {
        view_of: Some(0),
        ..Default::default()
    })
}

#[test]
fn every_op_of_every_golden_runs_on_the_cpu() {
    let dir = testkit::repo_root().join("tests/golden");
    let mut graphs = 0;
    for entry in std::fs::read_dir(dir).expect("the goldens are there") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "pb") {
            let graph = ir::io::load(&path).expect("the golden loads");
            let world = graph.metadata().world_size.max(1) as usize;
            Program::prepare(&graph, Device::Cpu, world)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            graphs += 1;
        }
    }
    assert!(graphs >= 10, "only {graphs} goldens found");
}

#[test]
fn an_unknown_op_is_refused_naming_the_op_and_its_first_node() {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    let (_, a) = b.node("aten.sin.default", &[&x]);
    let (first, y) = b.node("aten.no_such_op.default", &[&a]);
    b.node("aten.no_such_op.default", &[&y]);
    let graph = b.build();
    let err = Program::prepare(&graph, Device::Cpu, 1).unwrap_err();
    match err {
        PrepareError::Unsupported { op, node, .. } => {
            assert_eq!(op, "aten.no_such_op.default");
            assert_eq!(node, first);
        }
        other => panic!("expected an unsupported op, got {other}"),
    }
}

#[test]
fn an_op_with_only_a_cpu_kernel_is_refused_on_cuda() {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    let (node, _) = b.node("aten._convert_weight_to_int4pack_for_cpu.default", &[&x]);
    let mut wire = b.wire();
    wire.nodes[0].attributes.push(pb::Attribute {
        name: "innerKTiles".to_owned(),
        value: Some(pb::attribute::Value::Int(2)),
    });
    let graph = Graph::from_wire(wire).expect("valid");
    Program::prepare(&graph, Device::Cpu, 1).expect("runs on the CPU");
    let err = Program::prepare(&graph, Device::Cuda(0), 1).unwrap_err();
    assert_eq!(
        err,
        PrepareError::Unsupported {
            op: "aten._convert_weight_to_int4pack_for_cpu.default".to_owned(),
            node,
            reason: "libtorch has no kernel for it on cuda:0".to_owned(),
        }
    );
}

#[test]
fn the_cpu_exported_attention_runs_on_cuda_through_the_fallback() {
    let graph = common::golden("dense");
    Program::prepare(&graph, Device::Cuda(0), 1).expect("every op has a CUDA kernel");
}

#[test]
fn the_marker_runs_as_the_copy_eager_pytorch_makes() {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    let marked = b.marker("attn.begin", &x);
    b.output(&marked);
    let graph = b.build();
    let inputs = seeded_inputs(&graph);
    let result = step(&graph, &Schedule::no_checkpoint(&graph), &inputs);
    let input = &inputs.values[0].1;
    let output = &result.outputs[0].1;
    assert_ne!(ffi::storage(output), ffi::storage(input));
    assert!(check::identical(output, input));
    // Input and output are both live after the marker: two storages, as the planner counts.
    assert_eq!(result.peak_bytes, 2 * graph.value(graph.outputs()[0]).bytes);
}

#[test]
fn a_graph_input_nothing_reads_is_freed_after_the_first_step_as_the_planner_counts_it() {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    b.input("unused");
    let a = b.op(&x);
    let c = b.node("aten.cos.default", &[&a]).1;
    let product = b.node("aten.mul.Tensor", &[&a, &c]).1;
    b.output(&product);
    let graph = b.build();
    let result = step(
        &graph,
        &Schedule::no_checkpoint(&graph),
        &seeded_inputs(&graph),
    );
    // The peak is the product's step, `a`, `cos(a)` and the product live, and not `unused`.
    let value = graph.value(graph.outputs()[0]).bytes;
    assert_eq!(result.peak_bytes, 3 * value);
}

/// The sums `index_put` accumulates, added in index order one element at a time.
fn sums_in_index_order(dest: &Tensor, idx: &Tensor, vals: &Tensor) -> Tensor {
    let mut out = Vec::<f32>::try_from(dest.flatten(0, -1)).expect("floats");
    let rows = Vec::<i64>::try_from(idx).expect("indices");
    let added = Vec::<f32>::try_from(vals.flatten(0, -1)).expect("floats");
    let width = vals.size()[1] as usize;
    for (i, &row) in rows.iter().enumerate() {
        for j in 0..width {
            out[row as usize * width + j] += added[i * width + j];
        }
    }
    Tensor::from_slice(&out).view([dest.size()[0], dest.size()[1]])
}

#[test]
fn an_accumulating_index_put_sums_in_index_order_on_several_threads() {
    tch::set_num_threads(2);
    let graph = testkit::accumulating_index_put();
    let inputs = seeded_inputs(&graph);
    let input = |name: &str| {
        let (id, _) = graph.values().iter().find(|(_, v)| v.name == name).unwrap();
        inputs
            .values
            .iter()
            .find(|(v, _)| *v == id)
            .unwrap()
            .1
            .shallow_clone()
    };
    let expected = sums_in_index_order(&input("dest"), &input("idx"), &input("vals"));
    for _ in 0..3 {
        let result = step(&graph, &Schedule::no_checkpoint(&graph), &inputs);
        assert!(check::identical(&result.outputs[0].1, &expected));
    }
}

/// `x -> a -> b -> c` in layer 0; backward multiplies the running gradient by `c`, `b`, `a`.
fn chain() -> Graph {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x);
    let bb = b.op(&a);
    let c = b.op(&bb);
    b.backward_through("t", &[c, bb, a]);
    b.build()
}

/// The chain's plan: save `x` and the tangent, replay the layer before the first backward op.
fn chain_with_replay(graph: &Graph) -> Schedule {
    let mut saved = vec![false; graph.values().len()];
    for (id, v) in graph.values().iter() {
        saved[ir::EntityId::index(id)] = v.name == "x" || v.name == "t";
    }
    let replay = ReplaySpec {
        nodes: vec![node(graph, "n1"), node(graph, "n2"), node(graph, "n3")],
        before: node(graph, "n4"),
    };
    Schedule::new(graph, &saved, &[replay]).expect("the plan is closed")
}

#[test]
fn replay_reproduces_the_no_checkpoint_gradients_bit_for_bit() {
    let graph = chain();
    let inputs = seeded_inputs(&graph);
    let plain = step(&graph, &Schedule::no_checkpoint(&graph), &inputs);
    let replayed = step(&graph, &chain_with_replay(&graph), &inputs);
    assert_eq!(replayed.counts.total(ir::plan::Stage::Replay), 3);
    assert_eq!(plain.counts.total(ir::plan::Stage::Replay), 0);
    assert!(check::identical(
        &plain.outputs[0].1,
        &replayed.outputs[0].1
    ));
}

/// The chain with `a` (made by n1, read by n2 in forward and by n6 last in backward) offloaded:
/// it leaves after n3 (the step after its last forward read) and is back `prefetch` steps
/// before n6.
fn chain_offloading_a(graph: &Graph, prefetch: usize) -> Result<Schedule, ScheduleError> {
    let a = value(graph, "v1");
    Schedule::no_checkpoint(graph).offloading(graph, &[a], prefetch)
}

#[test]
fn an_offloaded_storage_is_off_the_device_between_the_step_after_its_last_forward_read_and_its_reload(
) {
    // Without offload the peak is at n4: t, a, b, c and n4's output. With `a` on the host from
    // the end of n3 to just before n6, it is t, a, b, c at n3 (4 storages), one fewer.
    let graph = chain();
    let inputs = seeded_inputs(&graph);
    let plain = step(&graph, &Schedule::no_checkpoint(&graph), &inputs);
    let schedule = chain_offloading_a(&graph, 0).expect("a has a gap");
    let offloaded = step(&graph, &schedule, &inputs);
    assert_eq!(plain.peak_bytes, 5 * 64);
    assert_eq!(offloaded.peak_bytes, 4 * 64);
    assert_eq!(offloaded.host.bytes.moved, 64);
    assert_eq!(offloaded.host.bytes.peak, 64);
    assert_eq!(plain.host.bytes.moved, 0);
    assert!(check::identical(
        &plain.outputs[0].1,
        &offloaded.outputs[0].1
    ));
}

#[test]
fn an_offload_whose_reload_would_come_before_its_copy_ends_is_refused() {
    // Two steps of prefetch bring `a` back before n4, the step right after its copy (beside
    // n3) ends: the device is never free of it.
    let graph = chain();
    assert!(chain_offloading_a(&graph, 1).is_ok());
    assert_eq!(
        chain_offloading_a(&graph, 2).unwrap_err(),
        ScheduleError::OffloadWithoutGap {
            value: "v1".to_owned()
        }
    );
}

#[test]
fn an_offloaded_storage_comes_back_with_its_views_strides() {
    // a = sin(x); v = a.t() (a view: a's storage, transposed strides); b = sin(a); backward
    // reads b, then v. Offloading a's storage moves v with it; the reload must rebuild v as
    // the transpose, or the gradient differs from the plain step's.
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    let a = b.op(&x);
    let (_, v) = b.node_with("aten.t.default", &[&a], view_of_input_0());
    let c = b.op(&a);
    let d = b.op(&c);
    b.backward_through("t", &[d, c, v]);
    let graph = b.build();
    let inputs = seeded_inputs(&graph);
    let plain = step(&graph, &Schedule::no_checkpoint(&graph), &inputs);
    let root = value(&graph, &a);
    let schedule = Schedule::no_checkpoint(&graph)
        .offloading(&graph, &[root], 0)
        .expect("a has a gap");
    let offloaded = step(&graph, &schedule, &inputs);
    assert_eq!(offloaded.host.bytes.moved, 64);
    assert!(offloaded.peak_bytes < plain.peak_bytes);
    assert!(check::identical(
        &plain.outputs[0].1,
        &offloaded.outputs[0].1
    ));
}

#[test]
fn an_offloaded_storage_comes_back_with_a_views_storage_offset() {
    // a = sin(x) of [8, 4]; v = a[4:8] (a view 16 elements into a's storage); c = sin(v),
    // d = sin(c); backward reads d, c, then v. Offloading a's storage moves v with it; the
    // reload must rebuild v at its offset, or the gradient reads a's first rows.
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    let a = b.op(&x);
    let (_, v) = b.node_with("aten.slice.Tensor", &[&a], view_of_input_0());
    let c = b.op(&v);
    let d = b.op(&c);
    b.backward_through("t", &[d, c, v.clone()]);
    let mut wire = b.wire();
    for value in wire
        .values
        .iter_mut()
        .filter(|w| w.name == x || w.name == a)
    {
        value.shape = vec![8, 4];
    }
    let int = |name: &str, i| pb::Attribute {
        name: name.to_owned(),
        value: Some(pb::attribute::Value::Int(i)),
    };
    let slice = wire
        .nodes
        .iter_mut()
        .find(|n| n.outputs == [v.clone()])
        .expect("the slice");
    slice.attributes = vec![
        int("dim", 0),
        int("start", 4),
        int("end", 8),
        int("step", 1),
    ];
    let graph = Graph::from_wire(wire).expect("valid");
    let inputs = seeded_inputs(&graph);
    let plain = step(&graph, &Schedule::no_checkpoint(&graph), &inputs);
    let schedule = Schedule::no_checkpoint(&graph)
        .offloading(&graph, &[value(&graph, &a)], 0)
        .expect("a has a gap");
    let offloaded = step(&graph, &schedule, &inputs);
    assert_eq!(offloaded.host.bytes.moved, 128);
    assert!(check::identical(
        &plain.outputs[0].1,
        &offloaded.outputs[0].1
    ));
}

#[test]
fn measured_peak_follows_the_schedule_one_storage_per_value() {
    // Every value is one 64-byte storage. Without checkpointing the peak is at the first
    // backward op: t, a, b, c and its output (5 storages). With the replay it is the same
    // instant after replay: t, a', b', c' and the output.
    let graph = chain();
    let inputs = seeded_inputs(&graph);
    let plain = step(&graph, &Schedule::no_checkpoint(&graph), &inputs);
    assert_eq!(plain.peak_bytes, 5 * 64);
    let replayed = step(&graph, &chain_with_replay(&graph), &inputs);
    assert_eq!(replayed.peak_bytes, 5 * 64);
}

#[test]
fn a_view_counts_once_with_its_base() {
    // v = alias(x); a = sin(v); backward g = a * t. x's storage lives on in v: the peak is
    // t, x|v, a = 3 storages, not 4.
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    let (_, v) = b.node_with("aten.alias.default", &[&x], view_of_input_0());
    let a = b.op(&v);
    b.backward_through("t", &[a]);
    let graph = b.build();
    let inputs = seeded_inputs(&graph);
    let result = step(&graph, &Schedule::no_checkpoint(&graph), &inputs);
    assert_eq!(result.peak_bytes, 3 * 64);
}

#[test]
fn a_plan_that_is_not_closed_is_refused_before_running() {
    let graph = chain();
    let saved = vec![false; graph.values().len()];
    let err = Schedule::new(&graph, &saved, &[]).unwrap_err();
    assert_eq!(
        err,
        ScheduleError::NotResident {
            stage: ir::plan::Stage::Backward,
            node: "n4".to_owned(),
            value: "v3".to_owned(),
        }
    );
}

/// `r = rand_like(x)`, `y = x * r` in layer 0, then `w = rand_like(x)` outside layers; backward
/// `g = y * t`, and a random op of its own: `out = g * rand_like(t) * w`. Replaying `r` must
/// neither draw anew nor rewind the stream that `w` and backward's draw continue.
fn random_layer() -> Graph {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    let t = b.tangent("t");
    b.layer(Some(0));
    let (_, r) = b.node_with("aten.rand_like.default", &[&x], random());
    let (_, y) = b.node("aten.mul.Tensor", &[&x, &r]);
    b.layer(None);
    let (_, w) = b.node_with("aten.rand_like.default", &[&x], random());
    b.backward();
    let (_, g) = b.node("aten.mul.Tensor", &[&y, &t]);
    let (_, n) = b.node_with("aten.rand_like.default", &[&t], random());
    let (_, gn) = b.node("aten.mul.Tensor", &[&g, &n]);
    let (_, out) = b.node("aten.mul.Tensor", &[&gn, &w]);
    b.output(&out);
    b.build()
}

#[test]
fn a_replayed_random_op_draws_what_it_drew_in_forward_and_later_draws_are_unchanged() {
    let graph = random_layer();
    let inputs = seeded_inputs(&graph);
    let plain = step(&graph, &Schedule::no_checkpoint(&graph), &inputs);
    let mut saved = vec![false; graph.values().len()];
    for (id, v) in graph.values().iter() {
        saved[ir::EntityId::index(id)] = ["x", "t", "v3"].contains(&v.name.as_str());
    }
    let replay = ReplaySpec {
        nodes: vec![node(&graph, "n1"), node(&graph, "n2")],
        before: node(&graph, "n4"),
    };
    let schedule = Schedule::new(&graph, &saved, &[replay]).expect("the plan is closed");
    let replayed = step(&graph, &schedule, &inputs);
    assert_eq!(replayed.counts.total(ir::plan::Stage::Replay), 2);
    assert!(check::identical(
        &plain.outputs[0].1,
        &replayed.outputs[0].1
    ));
}

#[test]
fn identical_needs_every_bit_and_the_reference_error_is_bounded_by_the_tolerance() {
    let a = tch::Tensor::from_slice(&[1.0f32, -2.0, 3.5]);
    let b = tch::Tensor::from_slice(&[1.0f32, -2.0, 3.5000002]);
    assert!(check::identical(&a, &a.copy()));
    assert!(!check::identical(&a, &b));
    let e = check::error(&b, &a);
    assert!(e.within && e.max_abs > 0.0 && e.max_abs < 1e-6, "{e:?}");
    let far = tch::Tensor::from_slice(&[1.0f32, -2.0, 3.6]);
    assert!(!check::error(&far, &a).within);
}
