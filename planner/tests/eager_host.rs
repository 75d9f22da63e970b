//! What eager PyTorch does on the CPU beyond the graph's ops, as the eager memory model counts
//! it: CPU dropout's mask is a noise tensor of the input's dtype, and a checkpoint of a layer
//! with random ops stashes the CPU generator state. A graph traced for a GPU counts neither.

use ir::{
    plan::Executor,
    wire::graph::{self as pb, attribute::Value as AttrValue},
    Graph, NodeId,
};
use planner::{
    config::{self, PlanConfig},
    memory::{simulate, simulate_executed, Executed},
    partition::{self, Extra, Resized, Until},
    policy,
};
use testkit::Builder;

/// Bytes of a `[4, 4]` float32 value (every builder value).
const VALUE: u64 = 64;
const STASH: u64 = 5056;

fn attr(name: &str, value: AttrValue) -> pb::Attribute {
    pb::Attribute {
        name: name.to_owned(),
        value: Some(value),
    }
}

/// `zeros(device=device)` added to the input, then per layer `sin`, dropout (p = 0.5: a
/// float output and a bool mask) and `sin` (with `dropout`; else two `sin`); backward reads
/// each layer's mask and first `sin`.
fn graph(device: &str, dropout: bool) -> Graph {
    let mut b = Builder::new(2, &[]);
    let x = b.input("x");
    let (zeros, z) = b.node("aten.zeros.default", &[]);
    let mut h = b.node("aten.add.Tensor", &[&x, &z]).1;
    let mut reads = Vec::new();
    let mut masks = Vec::new();
    for layer in 0..2 {
        b.layer(Some(layer));
        let a = b.op(&h);
        let (node, out) = if dropout {
            b.node_with(
                "aten.native_dropout.default",
                &[&a],
                Some(pb::SchemaFacts {
                    random: true,
                    ..Default::default()
                }),
            )
        } else {
            b.node("aten.sin.default", &[&a])
        };
        if dropout {
            masks.push((node, format!("mask{layer}")));
            reads.push(format!("mask{layer}"));
        }
        reads.push(a);
        h = b.op(&out);
    }
    b.layer(None);
    reads.push(h);
    reads.reverse();
    b.backward_through("t", &reads);
    let mut wire = b.wire();
    for (node, mask) in &masks {
        wire.values.push(pb::Value {
            name: mask.clone(),
            dtype: pb::Dtype::Bool as i32,
            shape: vec![4, 4],
            role: pb::Role::Activation as i32,
        });
        let n = wire.nodes.iter_mut().find(|n| &n.name == node).unwrap();
        n.outputs.push(mask.clone());
        n.attributes.push(attr("p", AttrValue::Float(0.5)));
        n.attributes.push(attr("train", AttrValue::Bool(true)));
    }
    let n = wire.nodes.iter_mut().find(|n| n.name == zeros).unwrap();
    n.attributes
        .push(attr("device", AttrValue::Str(device.to_owned())));
    Graph::from_wire(wire).expect("a valid graph")
}

fn eager() -> PlanConfig {
    PlanConfig {
        executor: Executor::Eager,
        ..PlanConfig::default()
    }
}

fn eager_partition(graph: &Graph) -> partition::Partition {
    let config = eager();
    let resolved = config::resolve(graph, &config).unwrap();
    let policy = policy::apply(graph, &config, &resolved);
    partition::partition(graph, &policy, Executor::Eager)
}

fn node(graph: &Graph, op: &str, k: usize) -> NodeId {
    graph
        .nodes()
        .iter()
        .filter(|(_, n)| n.op == op)
        .nth(k)
        .map(|(id, _)| id)
        .unwrap()
}

#[test]
fn eager_cpu_dropout_stores_its_mask_in_the_inputs_dtype() {
    let graph = graph("cpu", true);
    let masks: Vec<Resized> = (0..2)
        .map(|k| Resized {
            value: graph
                .node(node(&graph, "aten.native_dropout.default", k))
                .outputs[1],
            bytes: VALUE,
        })
        .collect();
    assert_eq!(
        graph.value(masks[0].value).bytes,
        VALUE / 4,
        "a bool mask in the graph"
    );
    assert_eq!(partition::resized(&graph, Executor::Eager), masks);
    assert_eq!(eager_partition(&graph).resized, masks);
    assert_eq!(partition::resized(&graph, Executor::Graph), vec![]);
}

#[test]
fn eager_dropout_of_a_gpu_graph_keeps_the_traced_mask() {
    let graph = graph("cuda:0", true);
    assert_eq!(partition::resized(&graph, Executor::Eager), vec![]);
    assert_eq!(eager_partition(&graph).resized, vec![]);
}

#[test]
fn a_cpu_checkpoint_of_a_layer_with_dropout_stashes_the_generator_state_until_its_frame_is_freed() {
    let graph = graph("cpu", true);
    let p = eager_partition(&graph);
    assert_eq!(p.replays.len(), 2);
    let mut expected = Vec::new();
    for layer in 0..2 {
        let first = node(&graph, "aten.sin.default", 2 * layer);
        let replay = p
            .replays
            .iter()
            .find(|r| r.layer.layer == layer as u32)
            .unwrap();
        // The frame is freed after the layer's last backward read: backward reads a layer's
        // first `sin`, then its mask.
        let mask = graph
            .node(node(&graph, "aten.native_dropout.default", layer))
            .outputs[1];
        let last_read = p
            .order
            .iter()
            .position(|&n| graph.node(n).inputs.contains(&mask))
            .unwrap();
        expected.push(Extra {
            bytes: STASH,
            from: Until::Forward(first),
            until: Until::Backward(last_read),
        });
        expected.push(Extra {
            bytes: STASH,
            from: Until::Replay(replay.nodes[0]),
            until: Until::Replay(*replay.nodes.last().unwrap()),
        });
    }
    assert_eq!(p.extras, expected);
}

#[test]
fn no_stash_without_random_ops_or_off_the_cpu() {
    assert_eq!(eager_partition(&graph("cpu", false)).extras, vec![]);
    assert_eq!(eager_partition(&graph("cuda:0", true)).extras, vec![]);
}

#[test]
fn extras_and_resized_values_count_in_the_simulated_peak() {
    let graph = graph("cuda:0", true);
    let order = graph.backward_order();
    let plain = simulate(&graph, order, &[], &[]).peak_bytes;
    let mask = graph
        .node(node(&graph, "aten.native_dropout.default", 0))
        .outputs[1];
    let resized = [Resized {
        value: mask,
        bytes: VALUE,
    }];
    let wider = simulate_executed(
        &graph,
        order,
        &[],
        Executed {
            resized: &resized,
            ..Executed::default()
        },
    );
    // The first mask is alive from its layer to the end of backward, at the peak.
    assert_eq!(wider.peak_bytes, plain + VALUE - VALUE / 4);
    let whole_step = [Extra {
        bytes: 1000,
        from: Until::Forward(node(&graph, "aten.zeros.default", 0)),
        until: Until::Backward(order.len() - 1),
    }];
    let extra = |extras: &[Extra]| {
        let executed = Executed {
            extras,
            ..Executed::default()
        };
        simulate_executed(&graph, order, &[], executed).peak_bytes
    };
    assert_eq!(extra(&whole_step), plain + 1000);
    // Allocated after the peak's step and freed at once: never at the peak.
    let brief = [Extra {
        bytes: 1,
        from: Until::Backward(order.len() - 1),
        until: Until::Backward(order.len() - 1),
    }];
    assert_eq!(extra(&brief), plain);
}
