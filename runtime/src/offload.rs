//! Offload: where the step moves each offloaded storage to host memory and brings it back.
//!
//! A plan marks the saved values whose storage goes to the host (`saved[].offloaded`). The
//! runtime finds, in its own schedule, the reads of each such storage through any copy that
//! shares it (the value, its views, their replayed views): the storage stays on the device
//! through the step after its last forward read (the copy to the host runs beside that step),
//! and comes back `prefetch` steps before its first read after forward (never before the
//! first backward step). A storage whose reload would come before its copy ends stays; a plan
//! that moves one has a window the runtime does not see, and is refused.

use ir::{plan::Stage, EntityId, Graph, ValueId};

use crate::schedule::{index, Schedule, ScheduleError};

/// One storage the step moves to the host and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Move {
    /// The forward value that made the storage.
    root: ValueId,
    /// The storage leaves the device once this step has run (its frees included).
    out_after: usize,
    /// It is back on the device before this step runs.
    back_before: usize,
}

/// The moves of one step, found in step order.
#[derive(Debug, Clone, Default)]
pub struct Moves {
    moves: Vec<Move>,
}

impl Moves {
    /// The moves of the storages `roots` (forward values that make a storage) in `schedule`,
    /// each reloaded `prefetch` steps before its first read after forward.
    pub fn find(
        graph: &Graph,
        schedule: &Schedule,
        roots: &[ValueId],
        prefetch: usize,
    ) -> Result<Moves, ScheduleError> {
        if roots.is_empty() {
            return Ok(Moves::default());
        }
        let reads = Reads::of(graph, schedule, roots);
        let moves = roots
            .iter()
            .map(|&root| {
                reads
                    .window(root, prefetch)
                    .ok_or_else(|| no_gap(graph, root))
            })
            .collect::<Result<_, _>>()?;
        Ok(Moves { moves })
    }

    /// Storages leaving the device once step `step` has run.
    pub fn out_after(&self, step: usize) -> impl Iterator<Item = ValueId> + '_ {
        self.moves
            .iter()
            .filter(move |m| m.out_after == step)
            .map(|m| m.root)
    }

    /// Storages coming back before step `step` runs.
    pub fn back_before(&self, step: usize) -> impl Iterator<Item = ValueId> + '_ {
        self.moves
            .iter()
            .filter(move |m| m.back_before == step)
            .map(|m| m.root)
    }

    /// Whether the storage `value` makes is moved.
    pub fn moves(&self, value: ValueId) -> bool {
        self.moves.iter().any(|m| m.root == value)
    }
}

fn no_gap(graph: &Graph, root: ValueId) -> ScheduleError {
    ScheduleError::OffloadWithoutGap {
        value: graph.value(root).name.to_string(),
    }
}

/// The reads of the offloaded storages, by step.
struct Reads {
    forward_steps: usize,
    /// Per root (by value index): the step it was made at, its last forward read and its
    /// first read after forward.
    made: Vec<Option<usize>>,
    last_forward: Vec<Option<usize>>,
    first_later: Vec<Option<usize>>,
}

impl Reads {
    /// Walks `schedule`, following which forward storage each copy shares: a node's output
    /// shares the storage of the input copy it views (or wrote in place), any other output
    /// made in forward owns a storage of its own.
    fn of(graph: &Graph, schedule: &Schedule, roots: &[ValueId]) -> Reads {
        let n = graph.values().len();
        let mut tracked = vec![false; n];
        for r in roots {
            tracked[r.index()] = true;
        }
        // Per copy (forward, replay, backward): the forward storage a value's copy shares
        // (none for a graph input's, which the step does not make).
        let mut storage: [Vec<Option<ValueId>>; 3] = [vec![None; n], vec![None; n], vec![None; n]];
        let mut reads = Reads {
            forward_steps: 0,
            made: vec![None; n],
            last_forward: vec![None; n],
            first_later: vec![None; n],
        };
        for (step, &(stage, id)) in schedule.steps().iter().enumerate() {
            let node = graph.node(id);
            let inputs: Vec<Option<ValueId>> = node
                .inputs
                .iter()
                .zip(schedule.reads(step))
                .map(|(&v, &copy)| storage[index(copy)][v.index()])
                .collect();
            for root in inputs.iter().flatten().filter(|r| tracked[r.index()]) {
                reads.read(*root, stage, step);
            }
            for (k, &v) in node.outputs.iter().enumerate() {
                let owner = match node.aliased_input(k) {
                    Some(i) => inputs.get(i).copied().flatten(),
                    None if stage == Stage::Forward => {
                        if tracked[v.index()] {
                            reads.made[v.index()] = Some(step);
                        }
                        Some(v)
                    }
                    None => None,
                };
                storage[index(stage)][v.index()] = owner;
            }
            if stage == Stage::Forward {
                reads.forward_steps = step + 1;
            }
        }
        // The graph's outputs are read when the step ends.
        let end = schedule.steps().len().saturating_sub(1);
        for slot_out in schedule.outputs() {
            let root = storage[index(slot_out.copy)][slot_out.value.index()];
            if let Some(root) = root.filter(|r| tracked[r.index()]) {
                reads.read(root, Stage::Backward, end);
            }
        }
        reads
    }

    fn read(&mut self, root: ValueId, stage: Stage, step: usize) {
        let i = root.index();
        if stage == Stage::Forward {
            self.last_forward[i] = Some(step);
        } else if self.first_later[i].is_none() {
            self.first_later[i] = Some(step);
        }
    }

    /// Where `root`'s storage leaves and comes back, if the device can be free of it for a
    /// step.
    fn window(&self, root: ValueId, prefetch: usize) -> Option<Move> {
        let i = root.index();
        let made = self.made[i]?;
        let out_after = self.last_forward[i].unwrap_or(made) + 1;
        let first_later = self.first_later[i]?;
        let back_before = first_later.saturating_sub(prefetch).max(self.forward_steps);
        (back_before > out_after + 1).then_some(Move {
            root,
            out_after,
            back_before,
        })
    }
}
