//! Every golden executes under the runtime with `--check` for every configuration the planner
//! offers it, every rank on its own exported tensors: results bit-identical to no checkpointing
//! and to whole-layer recompute, within tolerance of PyTorch's reference, measured peak equal to
//! the prediction to the byte (the plan's, no checkpointing's and whole-layer recompute's), and
//! no op a plan keeps ever re-runs in replay. A graph built here at a shape where activations
//! dominate the peak measures its predictions to the byte too.

#![cfg(feature = "run")]

use std::{sync::Arc, time::Duration};

use ir::{
    plan::{Collectives, Decision, Keep, Offload, Plan, RandomOps, SavedKind, Stage},
    Graph, NodeId,
};
use planner::{
    budget::{Granularity, Search, DEFAULT_STEPS},
    config::PlanConfig,
    cost::HwProfile,
    plan::plan,
};
use runtime::{
    run::{self, RankJob, RunConfig, RunReport, Variant},
    Device,
};

fn make_plan(graph: &Graph, config: &PlanConfig) -> Plan {
    plan(graph, config, &HwProfile::default()).expect("the golden plans")
}

/// The configurations every golden runs under: `--keep none`, `all`, `all` with every saved
/// activation offloaded, the units users keep most (`SAVE_DSA_INDEXER`,
/// `SAVE_MOE_DISPATCH`), `--collectives save`, `--recompute-ratio 0.5`, and `--keep all
/// --random-ops replay` for a graph with random ops.
fn configurations(graph: &Graph) -> Vec<(String, PlanConfig)> {
    let base = PlanConfig::default();
    let mut out = vec![
        ("keep none".to_owned(), base.clone()),
        (
            "keep all".to_owned(),
            PlanConfig {
                keep: Keep::All,
                ..base.clone()
            },
        ),
        (
            "keep all, offload every activation".to_owned(),
            offload_all(),
        ),
    ];
    for unit in ["SAVE_DSA_INDEXER", "SAVE_MOE_DISPATCH"] {
        let declared = graph
            .models()
            .values()
            .any(|m| m.units.values().any(|u| u.name == unit));
        if declared {
            out.push((
                format!("keep {unit}"),
                PlanConfig {
                    keep: Keep::Units(vec![unit.to_owned()]),
                    ..base.clone()
                },
            ));
        }
    }
    out.push((
        "collectives save".to_owned(),
        PlanConfig {
            collectives: Collectives::Save,
            ..base.clone()
        },
    ));
    out.push((
        "recompute ratio 0.5".to_owned(),
        PlanConfig {
            recompute_ratio: 0.5,
            ..base.clone()
        },
    ));
    if graph.nodes().values().any(|n| n.effects.random) {
        out.push((
            "keep all, random ops replay".to_owned(),
            PlanConfig {
                keep: Keep::All,
                random_ops: RandomOps::Replay,
                ..base
            },
        ));
    }
    out
}

/// `--keep all --offload-kinds kept,layer-input,not-checkpointed` at the default prefetch.
fn offload_all() -> PlanConfig {
    PlanConfig {
        keep: Keep::All,
        offload: Offload {
            kinds: vec![
                SavedKind::Kept,
                SavedKind::LayerInput,
                SavedKind::NotCheckpointed,
            ],
            ..Offload::default()
        },
        ..PlanConfig::default()
    }
}

/// Rank `rank`'s graph: its own `NAME.rank<r>.pb` where the ranks' graphs differ, else rank 0's.
fn rank_graph(golden: &str, rank: usize) -> Arc<Graph> {
    let path = runtime::inputs::rank_path(&testkit::golden_graph(golden), rank);
    let path = if path.exists() {
        path
    } else {
        testkit::golden_graph(golden)
    };
    Arc::new(ir::io::load(&path).expect("the golden loads"))
}

/// Runs `config` planned on every rank's graph of `golden` with `--check`.
fn run_checked(golden: &str, config: &PlanConfig) -> RunReport {
    let ranks = rank_graph(golden, 0).metadata().world_size.max(1) as usize;
    let jobs = (0..ranks)
        .map(|rank| {
            let inputs = testkit::golden_graph(golden).with_extension("safetensors");
            job(rank_graph(golden, rank), config, inputs)
        })
        .collect();
    run::run_loopback(jobs, &run_config(None))
        .unwrap_or_else(|e| panic!("{golden}: the run fails:\n{e}"))
}

/// One rank's job: `config`'s plan of `graph` and, for a joint graph, whole-layer recompute.
fn job(graph: Arc<Graph>, config: &PlanConfig, inputs: std::path::PathBuf) -> RankJob {
    let plan = make_plan(&graph, config);
    let whole_layer = plan
        .joint
        .then(|| Arc::new(make_plan(&graph, &PlanConfig::default())));
    RankJob {
        graph,
        plan: Arc::new(plan),
        whole_layer,
        inputs,
    }
}

/// `--check` on the CPU, inputs from the tensors file or, with `seed`, filled from it.
fn run_config(seed: Option<u64>) -> RunConfig {
    RunConfig {
        device: Device::Cpu,
        seed,
        check: true,
        timeout: Duration::from_secs(120),
        max_input_bytes: u64::MAX,
        fault: None,
        repeat: 1,
        cpu_memory: Default::default(),
    }
}

/// Every run of the rank (the plan, no checkpointing, whole-layer recompute) measures the peak
/// its plan predicts, holds the saved activation bytes it predicts when forward ends (on the
/// device and in host memory), and moves the bytes to host memory it predicts, to the byte.
fn assert_peaks_are_predicted(context: &str, rank: &run::RankReport) {
    for run in &rank.runs {
        let predicted_host = run.predicted_host.unwrap_or_default();
        assert_eq!(
            (run.host.bytes.moved, run.host.bytes.peak),
            (predicted_host.offloaded_bytes, predicted_host.peak_bytes),
            "{context}, rank {}, {}: bytes offloaded and host peak, measured vs predicted",
            rank.rank,
            run.variant.name(),
        );
        if let Some(predicted) = run.predicted_peak_bytes {
            assert_eq!(
                run.measured_peak_bytes,
                predicted,
                "{context}, rank {}, {}: measured vs predicted peak bytes",
                rank.rank,
                run.variant.name(),
            );
        }
        if let Some(predicted) = run.predicted_saved_bytes {
            assert_eq!(
                run.measured_saved_bytes,
                predicted,
                "{context}, rank {}, {}: measured vs predicted saved bytes",
                rank.rank,
                run.variant.name(),
            );
        }
    }
}

#[test]
fn at_an_activation_dominated_shape_every_run_measures_its_prediction_to_the_byte() {
    let graph = Arc::new(testkit::activation_dominated().build());
    for keep in [Keep::Nothing, Keep::All] {
        let config = PlanConfig {
            keep: keep.clone(),
            ..PlanConfig::default()
        };
        let jobs = vec![job(
            graph.clone(),
            &config,
            "/nonexistent.safetensors".into(),
        )];
        let report = run::run_loopback(jobs, &run_config(Some(5))).expect("the graph runs");
        assert_eq!(report.first_failure(), None);
        let rank = &report.ranks[0];
        assert_eq!(
            rank.runs.len(),
            3,
            "plan, no checkpointing, whole-layer recompute"
        );
        let gradients = graph.value(graph.outputs()[0]).bytes;
        let peak = rank.runs[1]
            .predicted_peak_bytes
            .expect("a joint graph's prediction");
        assert!(peak >= 10 * gradients, "activations dominate: {peak} B");
        assert_peaks_are_predicted(&format!("{keep:?}"), rank);
    }
}

/// The gradient of a batched-matmul MoE's expert weights is an accumulating `index_put`, whose
/// CPU kernel adds in no fixed order on several threads: the runs `--check` compares agree bit
/// for bit all the same (on this machine's cores; libtorch uses them all).
#[test]
fn an_accumulating_index_put_passes_check_whatever_the_thread_schedule() {
    let graph = Arc::new(testkit::accumulating_index_put());
    for _ in 0..3 {
        let jobs = vec![job(
            graph.clone(),
            &PlanConfig::default(),
            "/nonexistent.safetensors".into(),
        )];
        let report = run::run_loopback(jobs, &run_config(Some(5))).expect("the graph runs");
        assert_eq!(report.first_failure(), None);
        assert_eq!(
            report.ranks[0].runs.len(),
            2,
            "the plan and no checkpointing"
        );
    }
}

fn kept(plan: &Plan) -> Vec<NodeId> {
    plan.nodes
        .iter()
        .filter(|d| d.decision == Decision::Save)
        .map(|d| d.node)
        .collect()
}

fn check_golden(golden: &str) {
    let graph = rank_graph(golden, 0);
    for (label, config) in configurations(&graph) {
        let plan = make_plan(&graph, &config);
        // Every configuration of every golden plans (in-place writes of kept tensors are
        // demoted, not refused) and runs.
        assert!(
            !plan.has_errors(),
            "{golden} / {label}: {:?}",
            plan.diagnostics
        );
        if config.offload.is_asked() && plan.joint {
            assert!(
                plan.memory.offloaded_bytes > 0,
                "{golden} / {label}: something moves to the host"
            );
        }
        let kept = kept(&plan);
        let report = run_checked(golden, &config);
        let context = format!("{golden} / {label}");
        assert_eq!(report.first_failure(), None, "{context}");
        for rank in &report.ranks {
            if plan.joint {
                assert_eq!(
                    rank.reference_skipped, None,
                    "{context}: compared with PyTorch"
                );
                assert!(
                    rank.tensors.iter().all(|t| t.reference.is_some()),
                    "{context}"
                );
            }
            assert!(
                rank.tensors
                    .iter()
                    .all(|t| t.identical.iter().all(|(_, same)| *same)),
                "{context}"
            );
            assert_peaks_are_predicted(&context, rank);
            let plan_run = &rank.runs[0];
            assert_eq!(plan_run.variant, Variant::Plan);
            assert_eq!(
                run::replayed(&plan_run.counts, kept.iter().copied()),
                0,
                "{context}: a kept op ran in replay"
            );
        }
    }
}

macro_rules! goldens {
    ($($name:ident),* $(,)?) => {
        /// The goldens the matrix runs, one test each.
        const RUN: &[&str] = &[$(stringify!($name)),*];
        $(
            #[test]
            fn $name() {
                check_golden(stringify!($name));
            }
        )*
    };
}

goldens!(
    dense,
    dense_dropout,
    dense_forward,
    dsv3_kv_expand,
    moe_hf_router,
    moe_ep2,
    moe_ep2_compiled,
    moe_ep2_cuda,
    moe_ep4,
    moe_layer_compiled,
    moe_domino,
    moe_ep2_inplace,
    moe_ep2_unbalanced,
    glm_dsa_ep2,
    glm_dsa_ep2_compiled,
);

/// The golden graphs under `tests/golden/` (rank 0's; other ranks' are `NAME.rank<r>.pb`).
fn golden_names() -> Vec<String> {
    let dir = testkit::repo_root().join("tests/golden");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "pb"))
        .filter_map(|path| path.file_stem()?.to_str().map(str::to_owned))
        .filter(|stem| !stem.contains(".rank"))
        .collect();
    names.sort();
    names
}

/// No golden is left out of the matrix: `moe_ep2_cuda`, the graph of a GPU run, runs on the
/// CPU too (its device arguments run on the run's device).
#[test]
fn every_golden_graph_is_in_the_matrix() {
    let mut run = RUN.to_vec();
    run.sort_unstable();
    assert_eq!(golden_names(), run);
}

/// With `--keep save_dsa_indexer` the indexer's `aten.topk` (kept by the unit) runs zero times
/// in replay, where whole-layer recompute re-runs it in every layer.
fn check_indexer_topk_is_not_replayed(golden: &str) {
    let graph = rank_graph(golden, 0);
    let config = PlanConfig {
        keep: Keep::Units(vec!["SAVE_DSA_INDEXER".to_owned()]),
        ..PlanConfig::default()
    };
    let plan = make_plan(&graph, &config);
    let topk: Vec<NodeId> = plan
        .nodes
        .iter()
        .filter(|d| {
            d.unit
                .is_some_and(|u| graph.model(d.model).units[u].name == "SAVE_DSA_INDEXER")
                && graph.node(d.node).op == "aten.topk.default"
        })
        .map(|d| d.node)
        .collect();
    assert!(!topk.is_empty(), "{golden}: the indexer keeps its top-k");
    let report = run_checked(golden, &config);
    for rank in &report.ranks {
        let count = |variant| {
            let run = rank
                .runs
                .iter()
                .find(|r| r.variant == variant)
                .expect("ran");
            run::replayed(&run.counts, topk.iter().copied())
        };
        assert_eq!(count(Variant::Plan), 0, "{golden}: indexer top-k replayed");
        assert!(
            count(Variant::WholeLayer) >= topk.len() as u64,
            "{golden}: whole-layer recompute replays the indexer's top-k"
        );
        let plan_run = &rank.runs[0];
        assert!(
            plan_run.counts.total(Stage::Replay) > 0,
            "{golden}: the rest replays"
        );
    }
}

/// With `--keep save_dsa_indexer --offload save_dsa_indexer` the indexer's top-k is neither
/// replayed nor held on the device between forward and backward: the runtime moves it to host
/// memory (the bytes the plan predicts), and the device peaks lower than keeping it there.
fn check_indexer_topk_is_offloaded(golden: &str) {
    let graph = rank_graph(golden, 0);
    let keep = Keep::Units(vec!["SAVE_DSA_INDEXER".to_owned()]);
    let on_device = PlanConfig {
        keep: keep.clone(),
        ..PlanConfig::default()
    };
    let offloaded = PlanConfig {
        keep,
        offload: Offload {
            units: vec!["SAVE_DSA_INDEXER".to_owned()],
            prefetch: 0,
            ..Offload::default()
        },
        ..PlanConfig::default()
    };
    let plan = make_plan(&graph, &offloaded);
    let topk: Vec<NodeId> = plan
        .nodes
        .iter()
        .filter(|d| graph.node(d.node).op == "aten.topk.default" && d.unit.is_some())
        .map(|d| d.node)
        .collect();
    assert!(!topk.is_empty(), "{golden}: the indexer keeps its top-k");
    let topk_saved: Vec<_> = plan
        .saved
        .iter()
        .filter(|s| graph.producer(s.value).is_some_and(|p| topk.contains(&p)))
        .collect();
    assert!(
        !topk_saved.is_empty() && topk_saved.iter().all(|s| s.offloaded),
        "{golden}: the plan offloads the top-k it saves"
    );
    let kept_there = run_checked(golden, &on_device);
    let report = run_checked(golden, &offloaded);
    for (rank, there) in report.ranks.iter().zip(&kept_there.ranks) {
        let context = format!("{golden}, rank {}", rank.rank);
        assert_peaks_are_predicted(&context, rank);
        let run = &rank.runs[0];
        assert_eq!(
            run::replayed(&run.counts, topk.iter().copied()),
            0,
            "{context}"
        );
        let topk_bytes: u64 = topk_saved.iter().map(|s| s.bytes).sum();
        assert!(run.host.bytes.moved >= topk_bytes, "{context}");
        assert!(
            run.measured_peak_bytes < there.runs[0].measured_peak_bytes,
            "{context}: {} B offloaded vs {} B kept on the device",
            run.measured_peak_bytes,
            there.runs[0].measured_peak_bytes
        );
    }
}

#[test]
fn indexer_topk_offloaded_is_neither_replayed_nor_held_on_the_device() {
    check_indexer_topk_is_offloaded("glm_dsa_ep2");
    check_indexer_topk_is_offloaded("glm_dsa_ep2_compiled");
}

#[test]
fn indexer_topk_runs_zero_times_in_replay_with_save_dsa_indexer() {
    check_indexer_topk_is_not_replayed("glm_dsa_ep2");
    check_indexer_topk_is_not_replayed("glm_dsa_ep2_compiled");
}

#[test]
fn dropout_replays_with_the_forward_generator_state_bit_for_bit() {
    let graph = rank_graph("dense_dropout", 0);
    let config = PlanConfig {
        keep: Keep::All,
        random_ops: RandomOps::Replay,
        ..PlanConfig::default()
    };
    let dropouts: Vec<NodeId> = graph
        .nodes()
        .iter()
        .filter(|(_, n)| n.op == "aten.native_dropout.default")
        .map(|(id, _)| id)
        .collect();
    assert!(!dropouts.is_empty());
    let report = run_checked("dense_dropout", &config);
    assert_eq!(report.first_failure(), None);
    let rank = &report.ranks[0];
    assert!(run::replayed(&rank.runs[0].counts, dropouts.iter().copied()) > 0);
    assert!(rank
        .tensors
        .iter()
        .all(|t| t.identical.iter().all(|(_, same)| *same)));
}

/// A `--budget-offload` answer runs as it was planned. On a profile whose host link is fast and
/// overlapped, the largest budget just below a frontier point that the answer offloads for
/// (each rank plans its own graph at that budget): every rank measures the device peak, the
/// saved bytes, the bytes moved and the host peak its answer predicts, to the byte, with
/// results bit-identical to no checkpointing.
#[test]
fn a_budget_offload_answer_runs_with_the_peaks_it_predicts() {
    let golden = "moe_ep2";
    let hw = HwProfile {
        host_bytes_per_s: 1e15,
        asynchronous: true,
        ..HwProfile::default()
    };
    let answer = |graph: &Graph, budget: u64| -> Option<Plan> {
        let search = Search::new(graph, &PlanConfig::default(), &hw).expect("the golden searches");
        search.answer(budget, Granularity::Unit, true).ok()
    };
    let first = rank_graph(golden, 0);
    let search = Search::new(&first, &PlanConfig::default(), &hw).expect("the golden searches");
    let budget = search
        .frontier(DEFAULT_STEPS)
        .expect("a frontier")
        .iter()
        .rev()
        .map(|p| p.figures.peak_bytes - 1)
        .find(|&budget| answer(&first, budget).is_some_and(|a| !a.config.layer_offload.is_empty()))
        .expect("a budget the answer offloads for");
    let ranks = first.metadata().world_size.max(1) as usize;
    let jobs = (0..ranks)
        .map(|rank| {
            let graph = rank_graph(golden, rank);
            let plan = answer(&graph, budget).expect("every rank answers the budget");
            RankJob {
                whole_layer: Some(Arc::new(make_plan(&graph, &PlanConfig::default()))),
                plan: Arc::new(plan),
                graph,
                inputs: testkit::golden_graph(golden).with_extension("safetensors"),
            }
        })
        .collect();
    let report = run::run_loopback(jobs, &run_config(None))
        .unwrap_or_else(|e| panic!("{golden}: the run fails:\n{e}"));
    assert_eq!(report.first_failure(), None, "{golden} --budget-offload");
    for rank in &report.ranks {
        let context = format!("{golden} --budget-offload, rank {}", rank.rank);
        assert_peaks_are_predicted(&context, rank);
        assert!(
            rank.runs[0].host.bytes.moved > 0,
            "{context}: nothing moved"
        );
    }
}
