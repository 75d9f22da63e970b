//! What each rank is doing, seen from outside its thread: the op it runs and since when. The
//! run's watchdog ends a rank whose op runs longer than the limit, and a rank that panics is
//! reported with the op it was running.

use std::{
    sync::{Arc, Mutex},
    time::Instant,
};

use ir::{plan::Stage, Graph, NodeId};

/// What a rank is doing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Doing {
    /// Loading its inputs, preparing, or between ops.
    Other,
    /// Running `node`'s op, started at `since`. A collective is not `timed`: it has its own
    /// deadline, in the communicator.
    Op {
        stage: Stage,
        node: NodeId,
        since: Instant,
        timed: bool,
    },
}

impl Doing {
    /// `forward node `x` (aten.sum.default)`, or `None` outside an op.
    pub fn describe(self, graph: &Graph) -> Option<String> {
        match self {
            Doing::Other => None,
            Doing::Op { stage, node, .. } => {
                let node = graph.node(node);
                Some(format!(
                    "{stage} node `{}` ({})",
                    ir::display::name(&node.name),
                    node.op
                ))
            }
        }
    }
}

/// One rank's current activity, shared between its thread and the run's watchdog.
#[derive(Debug)]
pub struct RankActivity(Mutex<Doing>);

impl RankActivity {
    pub fn new() -> Arc<RankActivity> {
        Arc::new(RankActivity(Mutex::new(Doing::Other)))
    }

    /// What the rank is doing now.
    pub fn now(&self) -> Doing {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, doing: Doing) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = doing;
    }

    /// Marks the start of `node`'s op (`timed` unless it is a collective); the activity is
    /// cleared when the guard drops, unless the op panicked, so the panic can name it.
    pub fn enter(&self, stage: Stage, node: NodeId, timed: bool) -> OpGuard<'_> {
        self.set(Doing::Op {
            stage,
            node,
            since: Instant::now(),
            timed,
        });
        OpGuard(self)
    }
}

/// Clears a rank's activity when its op returns.
pub struct OpGuard<'a>(&'a RankActivity);

impl Drop for OpGuard<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.0.set(Doing::Other);
        }
    }
}
