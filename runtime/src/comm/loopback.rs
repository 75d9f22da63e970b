//! Ranks as threads of one process, exchanging real tensors through shared memory.
//!
//! Each collective is a round: every rank posts its contribution, waits until all ranks have
//! posted (or the group is aborted, or the timeout passes), then builds its own result from the
//! posts. Results are fresh tensors (concatenations and reductions copy), as they are with a
//! real transport. Reductions add the ranks' tensors in rank order, so a run is deterministic.

use std::{
    collections::BTreeMap,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use tch::Tensor;

use super::{
    average, check_input_splits, offsets, CommError, Communicator, Identity, ReduceOp, Site,
};
use crate::program::Collective;

/// A group of `world_size` loopback ranks; hand one [`Loopback`] to each rank's thread.
#[derive(Clone)]
pub struct LoopbackGroup {
    shared: Arc<Shared>,
}

struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Rounds in progress, by number: 0 is the agreement, then one per collective.
    rounds: BTreeMap<u64, Round>,
    /// Set once: the error every rank reports from now on.
    aborted: Option<CommError>,
}

struct Round {
    posts: Vec<Option<Post>>,
    /// Ranks that have taken their result; the round is dropped when all have.
    taken: usize,
}

/// One rank's contribution to a round.
struct Post {
    /// What the rank runs (`all_to_all_single at node x`), to detect ranks that diverge.
    what: String,
    payload: Payload,
}

enum Payload {
    Identity(Identity),
    /// One tensor per destination rank.
    Chunks(Vec<Tensor>),
    Whole(Tensor),
}

impl LoopbackGroup {
    pub fn new(world_size: usize, timeout: Duration) -> LoopbackGroup {
        LoopbackGroup {
            shared: Arc::new(Shared {
                world_size,
                timeout,
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
        }
    }

    /// The communicator of `rank`.
    pub fn rank(&self, rank: usize) -> Loopback {
        Loopback {
            rank,
            shared: Arc::clone(&self.shared),
            next_round: 0,
        }
    }

    /// Fails `rank` for every rank of the group, from outside that rank's thread.
    pub fn abort(&self, rank: usize, message: &str) {
        self.shared.abort(CommError::RankFailed {
            rank,
            message: message.to_owned(),
        });
    }

    /// The error the group was aborted with, if any.
    pub fn aborted(&self) -> Option<CommError> {
        self.shared.lock().aborted.clone()
    }

    /// Blocks until the group is aborted or `limit` passes; true if it was aborted. A rank
    /// injected to stall waits here, as a hung rank would, until the others give up.
    pub fn wait_for_abort(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut state = self.shared.lock();
        while state.aborted.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
        true
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking rank cannot leave the state half-written: every update is one
        // assignment. Carry on with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn abort(&self, error: CommError) {
        let mut state = self.lock();
        if state.aborted.is_none() {
            state.aborted = Some(error);
        }
        drop(state);
        self.changed.notify_all();
    }
}

/// One rank's end of a [`LoopbackGroup`].
pub struct Loopback {
    rank: usize,
    shared: Arc<Shared>,
    next_round: u64,
}

/// What a rank takes from a complete round: every rank's post, shallow copies.
struct Taken {
    what: Vec<String>,
    payloads: Vec<Payload>,
}

impl Payload {
    fn shallow(&self, rank: usize) -> Payload {
        match self {
            Payload::Identity(id) => Payload::Identity(id.clone()),
            // Only the chunk addressed to `rank` is needed.
            Payload::Chunks(chunks) => Payload::Chunks(
                chunks
                    .get(rank)
                    .map(Tensor::shallow_clone)
                    .into_iter()
                    .collect(),
            ),
            Payload::Whole(t) => Payload::Whole(t.shallow_clone()),
        }
    }
}

impl Loopback {
    /// Posts this rank's contribution to the next round and waits for every rank's.
    fn exchange(&mut self, site: Option<&Site>, post: Post) -> Result<Taken, CommError> {
        let round = self.next_round;
        self.next_round += 1;
        let shared = Arc::clone(&self.shared);
        let world = shared.world_size;
        let mut state = shared.lock();
        if let Some(error) = &state.aborted {
            return Err(error.clone());
        }
        let entry = state.rounds.entry(round).or_insert_with(|| Round {
            posts: (0..world).map(|_| None).collect(),
            taken: 0,
        });
        entry.posts[self.rank] = Some(post);
        shared.changed.notify_all();
        let deadline = Instant::now() + shared.timeout;
        loop {
            if let Some(error) = &state.aborted {
                return Err(error.clone());
            }
            let missing = state.rounds[&round].posts.iter().position(Option::is_none);
            let Some(missing) = missing else { break };
            let now = Instant::now();
            if now >= deadline {
                let error = CommError::Stalled {
                    rank: missing,
                    site: site.map_or_else(|| "the agreement check".to_owned(), Site::to_string),
                    seconds: shared.timeout.as_secs_f64(),
                };
                drop(state);
                shared.abort(error.clone());
                return Err(error);
            }
            state = shared
                .changed
                .wait_timeout(state, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
        let entry = state
            .rounds
            .get_mut(&round)
            .expect("the round is in progress");
        let posts = entry.posts.iter().flatten();
        let taken = Taken {
            what: posts.clone().map(|p| p.what.clone()).collect(),
            payloads: posts.map(|p| p.payload.shallow(self.rank)).collect(),
        };
        entry.taken += 1;
        if entry.taken == world {
            state.rounds.remove(&round);
        }
        Ok(taken)
    }

    /// Fails (and aborts the group) when another rank runs something else at this round.
    fn check_same(&self, site: &Site, mine: &str, taken: &Taken) -> Result<(), CommError> {
        match taken.what.iter().position(|w| w != mine) {
            None => Ok(()),
            Some(rank) => {
                let error = CommError::Diverged {
                    site: site.to_string(),
                    rank,
                    theirs: taken.what[rank].clone(),
                };
                self.shared.abort(error.clone());
                Err(error)
            }
        }
    }

    fn invalid(&self, site: &Site, message: String) -> CommError {
        let error = CommError::invalid(site, message);
        self.shared.abort(error.clone());
        error
    }

    fn all_to_all(
        &mut self,
        site: &Site,
        what: String,
        input: &Tensor,
        output_splits: &[i64],
        input_splits: &[i64],
    ) -> Result<Tensor, CommError> {
        let rows = input.size().first().copied().unwrap_or(0);
        if let Err(error) = check_input_splits(site, input_splits, rows) {
            self.shared.abort(error.clone());
            return Err(error);
        }
        let chunks = offsets(input_splits)
            .into_iter()
            .zip(input_splits)
            .map(|(start, &len)| input.narrow(0, start, len))
            .collect();
        let post = Post {
            what: what.clone(),
            payload: Payload::Chunks(chunks),
        };
        let taken = self.exchange(Some(site), post)?;
        self.check_same(site, &what, &taken)?;
        let mut received = Vec::with_capacity(taken.payloads.len());
        for (source, payload) in taken.payloads.into_iter().enumerate() {
            let Payload::Chunks(mut chunk) = payload else {
                return Err(self.invalid(site, format!("rank {source} posted no chunks")));
            };
            let chunk = chunk.pop().ok_or_else(|| {
                self.invalid(
                    site,
                    format!("rank {source} sends nothing to rank {}", self.rank),
                )
            })?;
            let got = chunk.size().first().copied().unwrap_or(0);
            let want = output_splits.get(source).copied().unwrap_or(-1);
            if got != want {
                return Err(self.invalid(
                    site,
                    format!(
                        "rank {source} sends {got} rows to rank {}, which expects {want}",
                        self.rank
                    ),
                ));
            }
            received.push(chunk);
        }
        Ok(Tensor::cat(&received, 0))
    }

    /// Every rank's whole input, in rank order, after checking they have one shape.
    fn gather(
        &mut self,
        site: &Site,
        what: String,
        input: &Tensor,
    ) -> Result<Vec<Tensor>, CommError> {
        let post = Post {
            what: what.clone(),
            payload: Payload::Whole(input.shallow_clone()),
        };
        let taken = self.exchange(Some(site), post)?;
        self.check_same(site, &what, &taken)?;
        let mut all = Vec::with_capacity(taken.payloads.len());
        for (source, payload) in taken.payloads.into_iter().enumerate() {
            match payload {
                Payload::Whole(t) if t.size() == input.size() && t.kind() == input.kind() => {
                    all.push(t)
                }
                _ => {
                    return Err(self.invalid(
                        site,
                        format!(
                            "rank {source}'s tensor differs in shape or dtype from rank {}'s {:?}",
                            self.rank,
                            input.size()
                        ),
                    ))
                }
            }
        }
        Ok(all)
    }
}

/// The ranks' tensors combined elementwise, in rank order.
fn reduce(tensors: &[Tensor], op: ReduceOp) -> Tensor {
    let mut acc = tensors[0].copy();
    for t in &tensors[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + t,
            ReduceOp::Max => acc.maximum(t),
            ReduceOp::Min => acc.minimum(t),
            ReduceOp::Product => acc * t,
        };
    }
    if op == ReduceOp::Avg {
        acc = average(acc, tensors.len());
    }
    acc
}

impl Communicator for Loopback {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn agree(&mut self, identity: &Identity) -> Result<(), CommError> {
        let post = Post {
            what: "agreement".to_owned(),
            payload: Payload::Identity(identity.clone()),
        };
        let taken = self.exchange(None, post)?;
        for (rank, payload) in taken.payloads.iter().enumerate() {
            match payload {
                Payload::Identity(theirs) if theirs == identity => {}
                Payload::Identity(theirs) => {
                    return Err(CommError::Mismatch {
                        me: self.rank,
                        mine: identity.describe(),
                        rank,
                        theirs: theirs.describe(),
                    })
                }
                _ => {
                    return Err(CommError::Transport(format!(
                        "rank {rank} ran a collective before agreeing on the graph and plan"
                    )))
                }
            }
        }
        Ok(())
    }

    fn run(
        &mut self,
        site: &Site,
        collective: &Collective,
        input: &Tensor,
    ) -> Result<Tensor, CommError> {
        let what = format!("{} at node `{}`", collective.name(), site.node);
        let world = self.shared.world_size as i64;
        match collective {
            Collective::AllToAll {
                output_splits,
                input_splits,
            } => self.all_to_all(site, what, input, output_splits, input_splits),
            Collective::AllGather => Ok(Tensor::cat(&self.gather(site, what, input)?, 0)),
            Collective::AllReduce(op) => Ok(reduce(&self.gather(site, what, input)?, *op)),
            Collective::ReduceScatter(op) => {
                let rows = input.size().first().copied().unwrap_or(0);
                if rows % world != 0 {
                    return Err(self.invalid(
                        site,
                        format!("{rows} rows do not split evenly over {world} ranks"),
                    ));
                }
                let reduced = reduce(&self.gather(site, what, input)?, *op);
                let share = rows / world;
                Ok(reduced.narrow(0, self.rank as i64 * share, share).copy())
            }
        }
    }

    fn abort(&mut self, message: &str) {
        self.shared.abort(CommError::RankFailed {
            rank: self.rank,
            message: message.to_owned(),
        });
    }
}
