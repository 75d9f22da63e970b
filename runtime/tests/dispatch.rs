//! Ops called through libtorch's dispatcher by schema name, bound from IR inputs and attributes.

use ir::{AttrValue, Attribute};
use runtime::ffi::{BindError, BoundCall};
use tch::{Device, Kind, Tensor};

fn attr(name: &str, value: AttrValue) -> Attribute {
    Attribute {
        name: name.into(),
        value,
    }
}

fn bind(op: &str, inputs: usize, attrs: &[Attribute]) -> BoundCall {
    BoundCall::bind(op, inputs, attrs, Device::Cpu, Device::Cpu).expect("binds")
}

#[test]
fn a_number_attribute_for_a_tensor_argument_is_a_wrapped_scalar() {
    let x = Tensor::from_slice(&[1.0f32, 2.0]);
    let call = bind("aten.add.Tensor", 1, &[attr("other", AttrValue::Int(3))]);
    let out = call.run(&[&x], 1).expect("runs");
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].kind(), Kind::Float);
    assert_eq!(Vec::<f32>::try_from(&out[0]).unwrap(), vec![4.0, 5.0]);
}

#[test]
fn tensor_lists_multiple_outputs_and_absent_tensors_bind() {
    let a = Tensor::from_slice(&[1.0f32, 5.0]);
    let b = Tensor::from_slice(&[3.0f32]);
    let cat = bind("aten.cat.default", 2, &[attr("dim", AttrValue::Int(0))]);
    let joined = cat.run(&[&a, &b], 1).unwrap().remove(0);
    assert_eq!(Vec::<f32>::try_from(&joined).unwrap(), vec![1.0, 5.0, 3.0]);

    let topk = bind("aten.topk.default", 1, &[attr("k", AttrValue::Int(2))]);
    let out = topk.run(&[&joined], 2).unwrap();
    assert_eq!(Vec::<f32>::try_from(&out[0]).unwrap(), vec![5.0, 3.0]);
    assert_eq!(Vec::<i64>::try_from(&out[1]).unwrap(), vec![1, 2]);

    let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0]).reshape([2, 2]);
    let target = Tensor::from_slice(&[0i64, 1]);
    let nll = bind(
        "aten.nll_loss_forward.default",
        2,
        &[
            attr("absent_tensor_args", AttrValue::Strs(vec!["weight".into()])),
            attr("reduction", AttrValue::Int(1)),
            attr("ignore_index", AttrValue::Int(-100)),
        ],
    );
    let out = nll.run(&[&logits, &target], 2).unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!(f32::try_from(&out[0]).unwrap(), -1.5);
    let _ = Kind::Float;
}

#[test]
fn the_attention_fallback_matches_libtorch_s_cpu_flash_attention() {
    // The fallback gives the CPU-only flash-attention op of CPU-exported graphs a CUDA kernel;
    // here it runs under its own name on the CPU, next to the kernel it stands in for.
    tch::manual_seed(5);
    let shape = [2, 3, 6, 4];
    let (q, k, v) = (
        Tensor::randn(shape, (Kind::Float, Device::Cpu)),
        Tensor::randn(shape, (Kind::Float, Device::Cpu)),
        Tensor::randn(shape, (Kind::Float, Device::Cpu)),
    );
    let no_mask = || {
        attr(
            "absent_tensor_args",
            AttrValue::Strs(vec!["attn_mask".into()]),
        )
    };
    let causal = [attr("is_causal", AttrValue::Bool(true)), no_mask()];
    let forward = |op| bind(op, 3, &causal).run(&[&q, &k, &v], 2).expect("runs");
    let want = forward("aten._scaled_dot_product_flash_attention_for_cpu.default");
    let got = forward("recompute_runtime.attention_math.default");
    let grad = Tensor::randn(shape, (Kind::Float, Device::Cpu));
    let backward_attrs = [
        attr("dropout_p", AttrValue::Float(0.0)),
        attr("is_causal", AttrValue::Bool(true)),
        no_mask(),
    ];
    let backward = |op, out: &[Tensor]| {
        bind(op, 6, &backward_attrs)
            .run(&[&grad, &q, &k, &v, &out[0], &out[1]], 3)
            .expect("runs")
    };
    let want_grads = backward(
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
        &want,
    );
    let got_grads = backward("recompute_runtime.attention_math_backward.default", &want);
    for (w, g) in want
        .iter()
        .chain(&want_grads)
        .zip(got.iter().chain(&got_grads))
    {
        let e = runtime::check::error(g, w);
        assert!(e.within, "{e:?}");
    }
}

#[test]
fn bernoulli_masks_draw_one_double_per_element_as_the_exported_reference_does() {
    // The exporter draws dropout masks as `rand(float64) < p` on every CPU; the runtime's
    // sampler must give the same mask from the same seed (PyTorch's MKL build would not, on
    // Intel CPUs).
    let _overrides = runtime::ffi::KernelOverrides::acquire().expect("installed");
    tch::manual_seed(3);
    let mut mask = Tensor::zeros([4096], (Kind::Float, Device::Cpu));
    let _ = mask.bernoulli_float_(0.3);
    tch::manual_seed(3);
    let want = Tensor::rand([4096], (Kind::Double, Device::Cpu))
        .lt(0.3)
        .to_kind(Kind::Float);
    assert!(runtime::check::identical(&mask, &want));
}

fn bind_error(op: &str, inputs: usize, attrs: &[Attribute]) -> BindError {
    BoundCall::bind(op, inputs, attrs, Device::Cpu, Device::Cpu).unwrap_err()
}

#[test]
fn a_missing_operator_is_its_own_error_and_a_node_that_does_not_fit_another() {
    for op in ["aten.no_such_op.default", "aten.mm.no_such_overload"] {
        assert_eq!(
            bind_error(op, 2, &[]),
            BindError::NoSuchOperator(op.to_owned())
        );
    }
    match bind_error("aten.mm.default", 1, &[]) {
        BindError::Mismatch(reason) => assert!(
            reason.contains("takes 2 tensor arguments but the node has 1 inputs"),
            "{reason}"
        ),
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn every_attribute_kind_reaches_the_shim_as_itself() {
    // `rounding_mode` is a string: every other kind is refused, named as the shim read it.
    let kinds = [
        (AttrValue::Int(1), "an int"),
        (AttrValue::Float(1.0), "a float"),
        (AttrValue::Bool(true), "a bool"),
        (AttrValue::Ints(vec![1]), "an int list"),
        (AttrValue::Floats(vec![1.0]), "a float list"),
        (AttrValue::Strs(vec!["floor".into()]), "a string list"),
    ];
    for (value, kind) in kinds {
        let attrs = [attr("rounding_mode", value)];
        match bind_error("aten.div.Tensor_mode", 2, &attrs) {
            BindError::Mismatch(reason) => assert!(
                reason.ends_with(&format!("but the IR attribute is {kind}")),
                "{reason}"
            ),
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
    let floor = bind(
        "aten.div.Tensor_mode",
        2,
        &[attr("rounding_mode", AttrValue::Str("floor".into()))],
    );
    let (a, b) = (Tensor::from_slice(&[7.0f32]), Tensor::from_slice(&[2.0f32]));
    let out = floor.run(&[&a, &b], 1).unwrap().remove(0);
    assert_eq!(Vec::<f32>::try_from(&out).unwrap(), vec![3.0]);
}
