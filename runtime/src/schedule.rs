//! The steps of one training step under a plan, and when each tensor is freed.
//!
//! Forward runs every forward node in execution order; backward runs in
//! [`Graph::backward_order`], each replay's nodes just before the backward node the plan names.
//! A value can exist in three copies: the forward one (graph inputs included), the replayed
//! one and the backward one. A read in replay sees the replayed copy if this or an earlier
//! replay made it, else the forward one; a read in backward sees the backward copy, else the
//! replayed one, else the forward one.
//!
//! A forward copy outlives forward only if the plan saves it (parameters are resident
//! anyway): every other forward value is freed right after its last forward use. Any later read
//! of a forward copy that is not saved means the plan is not closed, which is an error before
//! anything runs. Every copy is freed right after its last read; graph outputs live to the end.
//! A graph input nothing reads (a buffer the step never uses) is freed after the first step, as
//! an output nothing reads is freed after the step that made it. An offloaded storage leaves
//! the device between forward and backward ([`crate::offload`]).

use ir::{plan::Stage, EntityId, Graph, NodeId, Phase, Role, ValueId};
use thiserror::Error;

use crate::offload::Moves;

/// One of the (up to) three copies of a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub value: ValueId,
    /// The stage that made this copy (graph inputs: forward).
    pub copy: Stage,
}

/// One replay: forward nodes re-run just before a backward node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplaySpec {
    pub nodes: Vec<NodeId>,
    pub before: NodeId,
}

/// The plan cannot be executed as written.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ScheduleError {
    #[error("the plan is not closed: {stage} node `{node}` reads `{value}`, which the plan neither saves nor replays before it")]
    NotResident {
        stage: Stage,
        node: String,
        value: String,
    },
    #[error("a replay is scheduled before `{node}`, which is not a backward node of the graph")]
    ReplayAnchor { node: String },
    #[error("replay holds `{node}`, which is not a forward node")]
    ReplaysBackward { node: String },
    #[error(
        "the plan offloads `{value}`, but in this step its storage is read again before the \
         device could be free of it (or never after forward): the plan and the runtime disagree \
         on its window"
    )]
    OffloadWithoutGap { value: String },
    #[error(
        "the plan offloads for the {executor} executor, whose offload (held by what that \
         executor holds) the runtime does not run: plan it with `--executor graph`"
    )]
    OffloadForAnotherExecutor { executor: String },
    #[error(
        "the plan is for the compiled executor (the torch.compile stage, whose graphs hold no \
         unit marker), and the runtime runs each marker as the copy it is, so its memory would \
         not be the plan's: plan it with `--executor graph`"
    )]
    CompiledPlan,
}

/// The whole step, ready to run.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// `(stage, node)` in run order.
    steps: Vec<(Stage, NodeId)>,
    /// Per step, the copy each input reads (flattened; `read_start[s]..read_start[s + 1]`).
    reads: Vec<Stage>,
    read_start: Vec<usize>,
    /// Per step, the copies freed after it (flattened like `reads`).
    frees: Vec<Slot>,
    free_start: Vec<usize>,
    /// The copies of the graph outputs at the end.
    outputs: Vec<Slot>,
    /// The storages moved to host memory and back.
    moves: Moves,
}

impl Schedule {
    /// The step with `saved[v]` forward values kept for backward and `replays` in run order.
    pub fn new(
        graph: &Graph,
        saved: &[bool],
        replays: &[ReplaySpec],
    ) -> Result<Schedule, ScheduleError> {
        Builder::new(graph, saved).build(replays)
    }

    /// No checkpointing: every forward value backward reads stays, nothing replays.
    pub fn no_checkpoint(graph: &Graph) -> Schedule {
        let saved = vec![true; graph.values().len()];
        Builder::new(graph, &saved)
            .build(&[])
            .expect("with everything saved, every read is resident")
    }

    pub fn steps(&self) -> &[(Stage, NodeId)] {
        &self.steps
    }

    /// The copy each input of step `step` reads, in input order.
    pub fn reads(&self, step: usize) -> &[Stage] {
        &self.reads[self.read_start[step]..self.read_start[step + 1]]
    }

    /// The copies to free once step `step` has run.
    pub fn frees(&self, step: usize) -> &[Slot] {
        &self.frees[self.free_start[step]..self.free_start[step + 1]]
    }

    /// The copies the graph's outputs are at the end of the step.
    pub fn outputs(&self) -> &[Slot] {
        &self.outputs
    }

    /// This step with the storages of `roots` (forward values that make a storage) moved to
    /// host memory between forward and backward, each reloaded `prefetch` steps before its
    /// first read after forward ([`Moves::find`]).
    pub fn offloading(
        mut self,
        graph: &Graph,
        roots: &[ValueId],
        prefetch: usize,
    ) -> Result<Schedule, ScheduleError> {
        self.moves = Moves::find(graph, &self, roots, prefetch)?;
        Ok(self)
    }

    /// The storages this step moves to host memory and back.
    pub fn moves(&self) -> &Moves {
        &self.moves
    }
}

struct Builder<'a> {
    graph: &'a Graph,
    saved: &'a [bool],
    /// Per copy (forward, replay, backward): whether it exists at this point of the build.
    exists: [Vec<bool>; 3],
    /// Per copy: the last step that reads it.
    last: [Vec<Option<usize>>; 3],
    steps: Vec<(Stage, NodeId)>,
    reads: Vec<Stage>,
    read_start: Vec<usize>,
}

/// The position of `stage`'s copy among a value's three.
pub(crate) fn index(stage: Stage) -> usize {
    match stage {
        Stage::Forward => 0,
        Stage::Replay => 1,
        Stage::Backward => 2,
    }
}

impl<'a> Builder<'a> {
    fn new(graph: &'a Graph, saved: &'a [bool]) -> Self {
        let n = graph.values().len();
        let mut forward = vec![false; n];
        // Until a read says otherwise, a graph input's last use is the first step.
        let mut last_forward = vec![None; n];
        for (id, _) in graph.values().iter() {
            let input = graph.producer(id).is_none();
            forward[id.index()] = input;
            last_forward[id.index()] = input.then_some(0);
        }
        Builder {
            graph,
            saved,
            exists: [forward, vec![false; n], vec![false; n]],
            last: [last_forward, vec![None; n], vec![None; n]],
            steps: Vec::new(),
            reads: Vec::new(),
            read_start: vec![0],
        }
    }

    fn build(mut self, replays: &[ReplaySpec]) -> Result<Schedule, ScheduleError> {
        let graph = self.graph;
        for (id, node) in graph.nodes().iter() {
            if node.phase == Phase::Forward {
                self.step(Stage::Forward, id)?;
            }
        }
        let order = graph.backward_order();
        for replay in replays {
            if !order.contains(&replay.before) {
                return Err(ScheduleError::ReplayAnchor {
                    node: graph.node(replay.before).name.to_string(),
                });
            }
        }
        for &id in order {
            for replay in replays.iter().filter(|r| r.before == id) {
                for &n in &replay.nodes {
                    if graph.node(n).phase != Phase::Forward {
                        return Err(ScheduleError::ReplaysBackward {
                            node: graph.node(n).name.to_string(),
                        });
                    }
                    self.step(Stage::Replay, n)?;
                }
            }
            self.step(Stage::Backward, id)?;
        }
        let outputs = graph
            .outputs()
            .iter()
            .map(|&v| Slot {
                value: v,
                copy: self.visible(Stage::Backward, v).unwrap_or(Stage::Forward),
            })
            .collect();
        Ok(self.finish(outputs))
    }

    /// The copy of `value` a read in `stage` sees, if any is readable.
    fn visible(&self, stage: Stage, value: ValueId) -> Option<Stage> {
        let i = value.index();
        let has = |s: Stage| self.exists[index(s)][i];
        let candidates: &[Stage] = match stage {
            Stage::Forward => &[Stage::Forward],
            Stage::Replay => &[Stage::Replay, Stage::Forward],
            Stage::Backward => &[Stage::Backward, Stage::Replay, Stage::Forward],
        };
        candidates.iter().copied().find(|&s| {
            has(s) && (s != Stage::Forward || stage == Stage::Forward || self.resident(value))
        })
    }

    /// Whether the forward copy of `value` outlives forward.
    fn resident(&self, value: ValueId) -> bool {
        self.saved.get(value.index()).copied().unwrap_or(false)
            || self.graph.value(value).role == Role::Parameter
    }

    fn step(&mut self, stage: Stage, id: NodeId) -> Result<(), ScheduleError> {
        let at = self.steps.len();
        let node = self.graph.node(id);
        for &v in &node.inputs {
            let copy = self
                .visible(stage, v)
                .ok_or_else(|| ScheduleError::NotResident {
                    stage,
                    node: node.name.to_string(),
                    value: self.graph.value(v).name.to_string(),
                })?;
            self.last[index(copy)][v.index()] = Some(at);
            self.reads.push(copy);
        }
        for &v in &node.outputs {
            self.exists[index(stage)][v.index()] = true;
            // An output nobody reads is freed right after the step that made it.
            self.last[index(stage)][v.index()].get_or_insert(at);
        }
        self.read_start.push(self.reads.len());
        self.steps.push((stage, id));
        Ok(())
    }

    fn finish(self, outputs: Vec<Slot>) -> Schedule {
        let mut kept = [
            vec![false; self.graph.values().len()],
            vec![false; self.graph.values().len()],
            vec![false; self.graph.values().len()],
        ];
        for slot in &outputs {
            kept[index(slot.copy)][slot.value.index()] = true;
        }
        for (id, value) in self.graph.values().iter() {
            if value.role == Role::Parameter {
                kept[0][id.index()] = true;
            }
        }
        let mut by_step: Vec<Vec<Slot>> = vec![Vec::new(); self.steps.len()];
        for stage in Stage::ALL {
            for (i, last) in self.last[index(*stage)].iter().enumerate() {
                let Some(last) = *last else { continue };
                // A graph without steps frees nothing.
                if kept[index(*stage)][i] || last >= by_step.len() {
                    continue;
                }
                by_step[last].push(Slot {
                    value: ValueId::from_index(i),
                    copy: *stage,
                });
            }
        }
        let mut free_start = vec![0];
        let mut frees = Vec::new();
        for slots in by_step {
            frees.extend(slots);
            free_start.push(frees.len());
        }
        Schedule {
            steps: self.steps,
            reads: self.reads,
            read_start: self.read_start,
            frees,
            free_start,
            outputs,
            moves: Moves::default(),
        }
    }
}
