//! Helpers shared by the runtime's tests: goldens, plans without checkpointing, graphs built
//! op by op, and loopback ranks as threads.

#![allow(dead_code)]

use std::{path::PathBuf, sync::Arc, thread, time::Duration};

use ir::{
    plan::{Config, Cost, GraphRef, Keep, Memory, Plan, SavedKind, SavedValue},
    Graph,
};
use runtime::{
    comm::{loopback::LoopbackGroup, Communicator, Site},
    run::{RankJob, RunConfig},
    Device,
};

pub fn golden(name: &str) -> Graph {
    ir::io::load(&testkit::golden_graph(name)).expect("the golden loads")
}

pub fn golden_tensors(name: &str) -> PathBuf {
    testkit::golden_graph(name).with_extension("safetensors")
}

/// A plan that checkpoints nothing: every graph input and forward value is saved.
pub fn plan_without_checkpointing(graph: &Graph) -> Plan {
    let saved = graph
        .values()
        .iter()
        .map(|(value, v)| SavedValue {
            value,
            alias_of: None,
            bytes: v.bytes,
            model: None,
            layer: None,
            kind: SavedKind::NotCheckpointed,
            offloaded: false,
        })
        .collect();
    Plan {
        planner_version: ir::plan::PLANNER_VERSION.to_owned(),
        graph: GraphRef {
            name: graph.name().to_owned(),
            fingerprint: graph.fingerprint().to_owned(),
        },
        config: Config {
            keep: Keep::Nothing,
            recompute_ratio: 0.0,
            collectives: Default::default(),
            random_ops: Default::default(),
            executor: Default::default(),
            budget_bytes: None,
            layer_keep: Vec::new(),
            training: Default::default(),
            offload: Default::default(),
            layer_offload: Vec::new(),
        },
        joint: true,
        nodes: Vec::new(),
        saved,
        replay: Vec::new(),
        units: Vec::new(),
        memory: Memory::default(),
        cost: Cost::default(),
        diagnostics: Vec::new(),
    }
}

/// One job per rank running `graph` without checkpointing on the golden's tensors.
pub fn jobs(name: &str, ranks: usize) -> Vec<RankJob> {
    let graph = Arc::new(golden(name));
    let plan = Arc::new(plan_without_checkpointing(&graph));
    let job = RankJob {
        graph,
        plan,
        whole_layer: None,
        inputs: golden_tensors(name),
    };
    vec![job; ranks]
}

pub fn config(timeout: Duration) -> RunConfig {
    RunConfig {
        device: Device::Cpu,
        seed: Some(7),
        check: false,
        timeout,
        max_input_bytes: u64::MAX,
        fault: None,
        repeat: 1,
        cpu_memory: Default::default(),
    }
}

/// The site of collective number `seq`, an `op` called at node `node<seq>`.
pub fn site(seq: u64, op: &'static str) -> Site {
    Site {
        seq,
        op,
        node: format!("node{seq}"),
    }
}

/// Runs `body(rank, communicator)` on `world` threads, each a loopback rank; each rank's
/// result, in rank order.
pub fn on_loopback_ranks<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    body: impl Fn(usize, &mut dyn Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let group = LoopbackGroup::new(world, timeout);
    let body = Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let mut comm = group.rank(rank);
            let body = Arc::clone(&body);
            thread::spawn(move || body(rank, &mut comm))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("no rank panics"))
        .collect()
}
