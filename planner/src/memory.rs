//! Peak memory from a liveness simulation (docs/cost-and-memory.md).
//!
//! The step runs forward in execution order, then backward in order with each replay subgraph
//! materialised just before the backward node it is scheduled for. Every op output is a new
//! storage, except an alias (a view, `wait_tensor`, an in-place op's result), which shares the
//! storage of the input it aliases, so views cost nothing and extend their base's life. A
//! storage lives from the step that makes it to the last step that reads it (or any alias of
//! it); graph outputs (loss, gradients) live to the end. What is *saved* needs no bookkeeping:
//! a forward value that backward or replay reads simply stays alive until that read, and
//! everything else dies after its last forward use.
//!
//! Parameters are resident throughout and reported apart; so are the gradients among the graph
//! outputs. Collective buffers are ordinary op outputs and count like any other.

use ir::{
    plan::{Peak, Stage},
    EntityId, Graph, NodeId, Phase, ValueId,
};

use crate::partition::Replay;

/// What the simulation found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Simulation {
    /// Largest sum of live bytes (everything but parameters) at any step.
    pub peak_bytes: u64,
    /// Where the peak happens.
    pub peak: Option<Peak>,
    /// Bytes of the gradients the graph outputs, alive at the end of the step.
    pub gradient_bytes: u64,
}

/// One storage (a tensor's memory) and its lifetime in steps.
#[derive(Debug, Clone, Copy)]
struct Storage {
    bytes: u64,
    alloc: usize,
    last: usize,
}

/// Storage ids per value, per copy: the forward one, the replayed one, the backward one
/// ([`NO_STORAGE`] where there is none: 4 bytes a value, not 8).
struct Instances {
    forward: Vec<u32>,
    replayed: Vec<u32>,
    backward: Vec<u32>,
}

const NO_STORAGE: u32 = u32::MAX;

fn storage(id: u32) -> Option<u32> {
    (id != NO_STORAGE).then_some(id)
}

struct Simulator<'g> {
    graph: &'g Graph,
    storages: Vec<Storage>,
    inst: Instances,
    /// Steps run so far.
    steps: usize,
}

/// Simulates one training step with backward in `order` (see [`Graph::backward_order`]) under
/// the given replays (none: no checkpointing at all).
pub fn simulate(graph: &Graph, order: &[NodeId], replays: &[Replay]) -> Simulation {
    let n = graph.values().len();
    let mut sim = Simulator {
        graph,
        storages: Vec::with_capacity(graph.nodes().len()),
        inst: Instances {
            forward: vec![NO_STORAGE; n],
            replayed: vec![NO_STORAGE; n],
            backward: vec![NO_STORAGE; n],
        },
        steps: 0,
    };
    sim.place_graph_inputs();
    for (stage, id) in schedule(graph, order, replays) {
        sim.run(stage, id);
    }
    let (peak_bytes, peak_step, gradient_bytes) = sim.finish();
    Simulation {
        peak_bytes,
        peak: peak_step
            .and_then(|s| schedule(graph, order, replays).nth(s))
            .map(|(stage, node)| Peak { stage, node }),
        gradient_bytes,
    }
}

/// The steps of one training step: forward nodes in execution order, then backward in
/// `order` with each replay's nodes just before the node it is scheduled for.
fn schedule<'a>(
    graph: &'a Graph,
    order: &'a [NodeId],
    replays: &'a [Replay],
) -> impl Iterator<Item = (Stage, NodeId)> + 'a {
    let forward = graph
        .nodes()
        .iter()
        .filter(|(_, node)| node.phase == Phase::Forward)
        .map(|(id, _)| (Stage::Forward, id));
    let mut pending = replays.iter().peekable();
    let backward = order.iter().enumerate().flat_map(move |(at, &id)| {
        let mut due = Vec::new();
        while let Some(replay) = pending.next_if(|r| r.position <= at) {
            due.push(replay);
        }
        due.into_iter()
            .flat_map(|r| r.nodes.iter().map(|&n| (Stage::Replay, n)))
            .chain(std::iter::once((Stage::Backward, id)))
    });
    forward.chain(backward)
}

impl Simulator<'_> {
    /// Data inputs and tangents are alive from the start; parameters are counted apart.
    fn place_graph_inputs(&mut self) {
        for (id, value) in self.graph.values().iter() {
            if self.graph.producer(id).is_none() && value.role != ir::Role::Parameter {
                let storage = self.new_storage(value.bytes, 0);
                self.inst.forward[id.index()] = storage;
            }
        }
    }

    fn new_storage(&mut self, bytes: u64, step: usize) -> u32 {
        self.storages.push(Storage {
            bytes,
            alloc: step,
            last: step,
        });
        (self.storages.len() - 1) as u32
    }

    /// The storage a read of `value` at `stage` sees.
    fn read(&self, stage: Stage, value: ValueId) -> Option<u32> {
        let i = value.index();
        let forward = || storage(self.inst.forward[i]);
        match stage {
            Stage::Forward => forward(),
            Stage::Replay => storage(self.inst.replayed[i]).or_else(forward),
            Stage::Backward => storage(self.inst.backward[i])
                .or(storage(self.inst.replayed[i]))
                .or_else(forward),
        }
    }

    fn run(&mut self, stage: Stage, id: NodeId) {
        let step = self.steps;
        self.steps += 1;
        let node = self.graph.node(id);
        for &v in &node.inputs {
            if let Some(s) = self.read(stage, v) {
                self.storages[s as usize].last = step;
            }
        }
        for (k, &v) in node.outputs.iter().enumerate() {
            let storage = match node.aliased_input(k) {
                // None when the base is a parameter (no storage): the view is resident memory
                // too, counted in `parameter_bytes`.
                Some(p) => self.read(stage, node.inputs[p]),
                None => Some(self.new_storage(self.graph.value(v).bytes, step)),
            };
            let slot = match stage {
                Stage::Forward => &mut self.inst.forward,
                Stage::Replay => &mut self.inst.replayed,
                Stage::Backward => &mut self.inst.backward,
            };
            slot[v.index()] = storage.unwrap_or(NO_STORAGE);
        }
    }

    /// The peak, the step it is first reached at, and the bytes of the output gradients.
    fn finish(mut self) -> (u64, Option<usize>, u64) {
        let end = self.steps.saturating_sub(1);
        let mut gradient_bytes = 0u64;
        for &v in self.graph.outputs() {
            if let Some(s) = self.read(Stage::Backward, v) {
                self.storages[s as usize].last = end;
            }
            if self.graph.value(v).role == ir::Role::Gradient {
                gradient_bytes = gradient_bytes.saturating_add(self.graph.value(v).bytes);
            }
        }
        let (peak_bytes, peak_step) = peak(&self.storages, self.steps);
        (peak_bytes, peak_step, gradient_bytes)
    }
}

/// The largest sum of live bytes over steps, and the first step where it is reached.
fn peak(storages: &[Storage], steps: usize) -> (u64, Option<usize>) {
    let mut delta = vec![0i128; steps + 1];
    for s in storages {
        delta[s.alloc] += i128::from(s.bytes);
        delta[s.last + 1] -= i128::from(s.bytes);
    }
    let (mut live, mut best, mut at) = (0i128, 0i128, None);
    for (step, d) in delta.iter().take(steps).enumerate() {
        live += d;
        if live > best {
            best = live;
            at = Some(step);
        }
    }
    (u64::try_from(best).unwrap_or(u64::MAX), at)
}

#[cfg(test)]
mod tests {
    use super::peak;
    use super::Storage;

    #[test]
    fn peak_counts_overlapping_lifetimes_once_each() {
        let s = |bytes, alloc, last| Storage { bytes, alloc, last };
        // 10 lives 0..=1, 20 lives 1..=2, 5 lives 3..=3: the peak is 30 at step 1.
        let storages = [s(10, 0, 1), s(20, 1, 2), s(5, 3, 3)];
        assert_eq!(peak(&storages, 4), (30, Some(1)));
        assert_eq!(peak(&[], 0), (0, None));
    }
}
