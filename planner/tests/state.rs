//! M4, the whole training state on one device (docs/cost-and-memory.md), on a hand-built
//! graph whose tensors are all `[4, 4]` float32 (64 bytes, 16 elements), and the device-total
//! budget on a golden.

use ir::{
    plan::{DevicePhase, DeviceTotal, Keep, Optimizer, StateDtype, Training},
    wire::graph as pb,
    Graph,
};
use planner::{
    budget::{Granularity, Search},
    config::PlanConfig,
    cost::HwProfile,
    memory::{simulate_sharded, Executed},
    plan::plan,
    state::{BudgetBasis, State},
};
use testkit::Builder;

const ATTN: (&str, &[(&str, &str)]) = ("SAVE_ATTN", &[("attn.begin", "attn.end")]);

/// An embedding-like parameter read outside layers (the root's) and one parameter in each of
/// two layers; backward makes the three gradients, each in its parameter's layer.
fn two_layers() -> Graph {
    Graph::from_wire(two_layers_wire()).expect("a valid graph")
}

fn two_layers_wire() -> pb::Graph {
    let mut b = Builder::new(2, &[ATTN]);
    let x = b.input("x");
    let we = b.param("w_embed");
    let w0 = b.param("w0");
    let w1 = b.param("w1");
    let e = b.node("aten.mul.Tensor", &[&x, &we]).1;
    b.layer(Some(0));
    let a = b.node("aten.mul.Tensor", &[&e, &w0]).1;
    b.layer(Some(1));
    let c = b.node("aten.mul.Tensor", &[&a, &w1]).1;
    b.layer(None);
    let t = b.tangent("t");
    b.backward().layer(Some(1));
    let _ = c;
    let g_w1 = b.node("aten.mul.Tensor", &[&a, &t]).1;
    let g_a = b.node("aten.mul.Tensor", &[&w1, &t]).1;
    b.layer(Some(0));
    let g_w0 = b.node("aten.mul.Tensor", &[&e, &g_a]).1;
    let g_e = b.node("aten.mul.Tensor", &[&w0, &g_a]).1;
    b.layer(None);
    let g_we = b.node("aten.mul.Tensor", &[&x, &g_e]).1;
    let gradients = [g_w1, g_w0, g_we];
    for g in &gradients {
        b.output(g);
    }
    let mut wire = b.wire();
    for v in &mut wire.values {
        if gradients.contains(&v.name) {
            v.role = pb::Role::Gradient as i32;
        }
    }
    wire
}

fn device(graph: &Graph, training: Training) -> (DeviceTotal, ir::plan::Memory) {
    let config = PlanConfig {
        training,
        ..PlanConfig::default()
    };
    let memory = plan(graph, &config, &HwProfile::default()).unwrap().memory;
    (
        memory.device.expect("a joint graph has a device total"),
        memory,
    )
}

#[test]
fn m4_unsharded_the_device_holds_every_parameter_adamw_moments_and_the_plans_peak() {
    let graph = two_layers();
    let (d, memory) = device(&graph, Training::default());
    // Three parameters of 64 B; AdamW's two fp32 moments of 16 elements each per parameter.
    assert_eq!(d.parameter_bytes, 3 * 64);
    assert_eq!(d.optimizer_state_bytes, 3 * 2 * 16 * 4);
    assert_eq!(d.master_weight_bytes, 0);
    // Gradients are op outputs: the peak holds them, nothing is added.
    assert_eq!(d.activation_bytes, memory.peak_bytes.unwrap());
    // The step: parameters, gradients, moments and one moment of scratch.
    assert_eq!(d.optimizer_step_bytes, 192 + 192 + 384 + 192);
    let forward_backward = 192 + 384 + d.activation_bytes;
    assert_eq!(d.total_bytes, forward_backward.max(d.optimizer_step_bytes));
    assert_eq!(d.memory_bytes, 141 << 30);
}

#[test]
fn m4_the_optimizer_and_its_state_dtype_set_the_state_bytes() {
    let graph = two_layers();
    let with = |optimizer, state_dtype| {
        device(
            &graph,
            Training {
                optimizer,
                state_dtype,
                ..Training::default()
            },
        )
        .0
    };
    let sgd = with(Optimizer::Sgd, StateDtype::F32);
    assert_eq!(sgd.optimizer_state_bytes, 3 * 16 * 4);
    // SGD updates in place: parameters, gradients and the momentum.
    assert_eq!(sgd.optimizer_step_bytes, 3 * 64 * 3);
    assert_eq!(
        with(Optimizer::None, StateDtype::F32).optimizer_state_bytes,
        0
    );
    // The parameters are fp32 here: their own dtype is 4 bytes too.
    assert_eq!(
        with(Optimizer::AdamW, StateDtype::Param).optimizer_state_bytes,
        3 * 2 * 64
    );
}

#[test]
fn m4_master_weights_are_counted_only_for_parameters_narrower_than_fp32() {
    let graph = two_layers();
    let training = Training {
        master_weights: true,
        ..Training::default()
    };
    assert_eq!(device(&graph, training).0.master_weight_bytes, 0);
    let mut wire = two_layers_wire();
    for v in &mut wire.values {
        v.dtype = pb::Dtype::Bfloat16 as i32;
    }
    let narrow = Graph::from_wire(wire).unwrap();
    // 48 bf16 parameter elements, an fp32 copy of each.
    assert_eq!(device(&narrow, training).0.master_weight_bytes, 48 * 4);
}

#[test]
fn m4_fsdp_shards_the_state_and_adds_the_root_and_two_layers_unsharded() {
    let graph = two_layers();
    let (d, memory) = device(
        &graph,
        Training {
            fsdp: 4,
            ..Training::default()
        },
    );
    // The shard of 192 B, the root's 64 B (w_embed, read outside layers) and two layers of
    // 64 B each (the largest layer owns one parameter).
    assert_eq!(d.parameter_bytes, 48 + 64 + 2 * 64);
    assert_eq!(d.optimizer_state_bytes, 384 / 4);
    // Gradients sharded as they are reduce-scattered: at most two layers' flat copies (64 B
    // each) above the unsharded peak.
    assert!(d.activation_bytes <= memory.peak_bytes.unwrap() + 2 * 64);
    assert_eq!(d.optimizer_step_bytes, 48 + 48 + 96 + 48);
    assert_eq!(d.phase, DevicePhase::ForwardBackward);
    assert_eq!(
        d.total_bytes,
        d.parameter_bytes + d.optimizer_state_bytes + d.activation_bytes
    );
}

#[test]
fn m4_a_layers_gradients_are_whole_until_its_backward_ends_then_sharded() {
    let graph = two_layers();
    let order = graph.backward_order();
    // Unsharded (64 B a tensor), steps: e, a, c | g_w1, g_a (layer 1), g_w0, g_e (layer 0),
    // g_we. Five tensors are live from `c` on: 320 B.
    let whole = simulate_sharded(&graph, order, &[], Executed::default(), 1);
    assert_eq!(whole.peak_bytes, 320);
    assert_eq!(whole.peak_sharded_gradients, 320);
    // Four ways: at g_a, layer 1's backward ends: x, t, e, g_w1, g_a and the 64 B copy of
    // layer 1's gradients reduce-scattered, 384 B; at g_e, layer 0's end, g_w1 is a 16 B
    // shard: x, g_w1 / 4, g_a, g_w0, g_e, layer 1's copy (until now) and layer 0's, 400 B.
    let sharded = simulate_sharded(&graph, order, &[], Executed::default(), 4);
    assert_eq!(sharded.peak_bytes, 320);
    assert_eq!(sharded.peak_sharded_gradients, 400);
}

#[test]
fn m4_a_device_total_budget_answers_a_plan_whose_device_total_fits() {
    let graph = ir::io::load(&testkit::golden_graph("glm_dsa_ep2")).unwrap();
    let hw = HwProfile::default();
    for training in [
        Training::default(),
        Training {
            fsdp: 2,
            optimizer: Optimizer::Sgd,
            state_dtype: StateDtype::F32,
            master_weights: true,
        },
    ] {
        let config = PlanConfig {
            training,
            ..PlanConfig::default()
        };
        let everything = plan(
            &graph,
            &PlanConfig {
                keep: Keep::All,
                ..config.clone()
            },
            &hw,
        )
        .unwrap();
        // Under FSDP the search leaves room for two layers' reduce-scatter copies: at most the
        // gradients.
        let budget = everything.memory.device.unwrap().total_bytes
            + everything.memory.gradient_bytes * u64::from(training.fsdp > 1);
        let state = State::of(&graph, &training);
        let activations = state
            .activation_budget(budget, BudgetBasis::TrainingState)
            .unwrap();
        let answer = Search::new(&graph, &config, &hw)
            .unwrap()
            .answer(activations, Granularity::Unit, false)
            .unwrap();
        let total = answer.memory.device.unwrap().total_bytes;
        assert!(total <= budget, "{training:?}: {total} > {budget}");
        // A budget the training state alone fills is refused, naming it.
        let error = state
            .activation_budget(1024, BudgetBasis::TrainingState)
            .unwrap_err();
        assert!(error.to_string().contains("alone"), "{error}");
    }
}
