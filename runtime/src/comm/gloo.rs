//! CPU ranks in separate processes, through gloo: libtorch's own `c10d::ProcessGroupGloo`, the
//! process group PyTorch runs CPU collectives with.
//!
//! Ranks meet at rank 0's [`Hub`](super::rendezvous::Hub) (found through the launcher's
//! store, see [`launch`](super::launch)): it checks that they run the same graph and plan, and
//! its connections then carry arrivals and aborts. The gloo group forms through the same
//! store. Each collective is started on the group and polled: it ends when it completes, when
//! the hub relays another rank's failure, or after the timeout, when this rank reports it and
//! the hub names the rank that never reached the collective. A collective gloo fails (a peer's
//! process died) waits for the hub's abort, which names that rank.

use std::{
    net::SocketAddr,
    thread,
    time::{Duration, Instant},
};

use tch::{Kind, Tensor};

use super::{
    agree_with_joined, average,
    c10d::{GlooGroup, Progress, Reduction, Store, Work},
    check_input_splits,
    rendezvous::Coordinator,
    rows_like, CommError, Communicator, Identity, ReduceOp, Site,
};
use crate::program::Collective;

/// The store prefix of the gloo group's keys.
const GROUP_PREFIX: &str = "planner/gloo";

/// How long a rank whose collective gloo failed waits for the hub to name a peer that died.
const PEER_GRACE: Duration = Duration::from_secs(2);

/// How long a rank sleeps between looks at a running collective.
const POLL: Duration = Duration::from_micros(50);

/// One rank's gloo communicator.
pub struct Gloo {
    rank: usize,
    world: usize,
    identity: Identity,
    /// `None` once abandoned (a collective did not complete).
    group: Option<GlooGroup>,
    coordinator: Coordinator,
}

impl Gloo {
    /// Joins the rendezvous at `hub` as `rank` of `world`, then forms the gloo group through
    /// `store` (bounded by the timeout, like everything else).
    pub fn connect(
        store: &Store,
        hub: SocketAddr,
        rank: usize,
        world: usize,
        identity: Identity,
        timeout: Duration,
    ) -> Result<Gloo, CommError> {
        let (coordinator, _) = Coordinator::join(hub, rank, world, &identity, timeout)?;
        // gloo's own deadline lies beyond this rank's, so the hub names a stalled rank first.
        let group = GlooGroup::new(store, GROUP_PREFIX, rank, world, timeout * 2).map_err(|e| {
            // A peer that died is named by the hub; otherwise the failure is this rank's.
            let named = coordinator.wait_aborted(timeout.min(PEER_GRACE));
            named.unwrap_or_else(|| {
                let error = CommError::Transport(format!("the gloo group did not form: {e}"));
                coordinator.abort(&error.to_string());
                error
            })
        })?;
        Ok(Gloo {
            rank,
            world,
            identity,
            group: Some(group),
            coordinator,
        })
    }

    fn group(&self) -> Result<&GlooGroup, CommError> {
        self.group
            .as_ref()
            .ok_or_else(|| CommError::Transport("the gloo group was abandoned".to_owned()))
    }

    /// Starts the collective `start` builds, once the hub knows this rank reached it, and
    /// waits for it.
    fn collective(
        &mut self,
        site: &Site,
        start: impl FnOnce(&GlooGroup) -> Result<Work, String>,
    ) -> Result<(), CommError> {
        if let Some(error) = self.coordinator.aborted() {
            return Err(error);
        }
        self.coordinator.arrive(site.seq);
        let work = start(self.group()?).map_err(|e| CommError::invalid(site, e))?;
        self.wait(site, &work).inspect_err(|_| {
            // The collective may never complete: destroying the group would wait for it.
            if let Some(group) = self.group.take() {
                group.abandon();
            }
        })
    }

    fn wait(&self, site: &Site, work: &Work) -> Result<(), CommError> {
        let timeout = self.coordinator.timeout();
        let deadline = Instant::now() + timeout;
        loop {
            match work.poll() {
                Progress::Done => return Ok(()),
                Progress::Failed(message) => {
                    // A peer that died closes its gloo connections and its hub connection at
                    // once: the hub's abort, naming it, follows within moments. Without one,
                    // the failure is this rank's own (gloo refused the tensors).
                    let grace = timeout.min(PEER_GRACE);
                    return Err(self.coordinator.wait_aborted(grace).unwrap_or_else(|| {
                        CommError::Transport(format!("{site}: gloo: {message}"))
                    }));
                }
                Progress::Running => {}
            }
            if let Some(error) = self.coordinator.aborted() {
                return Err(error);
            }
            if Instant::now() >= deadline {
                self.coordinator.timed_out(site.seq, &site.to_string());
                return Err(self.coordinator.wait_aborted(timeout).unwrap_or_else(|| {
                    CommError::Transport(format!(
                        "{site} did not complete within {} s and the hub did not answer",
                        timeout.as_secs_f64()
                    ))
                }));
            }
            thread::sleep(POLL);
        }
    }
}

/// gloo's reduction for `op`; an average is a sum divided afterwards.
fn reduction(op: ReduceOp) -> Reduction {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => Reduction::Sum,
        ReduceOp::Product => Reduction::Product,
        ReduceOp::Min => Reduction::Min,
        ReduceOp::Max => Reduction::Max,
    }
}

fn finish_reduction(tensor: Tensor, op: ReduceOp, world: usize) -> Tensor {
    if op == ReduceOp::Avg {
        average(tensor, world)
    } else {
        tensor
    }
}

/// `rows` leading-dimension rows of `like`'s trailing shape, empty.
fn empty_rows(like: &Tensor, rows: i64) -> Tensor {
    Tensor::empty(rows_like(like, rows), (like.kind(), like.device()))
}

/// The element types gloo moves (`GENERATE_ALL_TYPES` of ProcessGroupGloo).
const GLOO_KINDS: [Kind; 9] = [
    Kind::Float,
    Kind::Double,
    Kind::Half,
    Kind::BFloat16,
    Kind::Int8,
    Kind::Uint8,
    Kind::Bool,
    Kind::Int,
    Kind::Int64,
];

/// `tensor` as gloo can move it: other one-byte types (float8) as bytes, same shape; other
/// types as they are, for gloo to refuse by name.
fn movable(tensor: &Tensor) -> Tensor {
    let kind = tensor.kind();
    if !GLOO_KINDS.contains(&kind) && kind.elt_size_in_bytes() == 1 {
        tensor.view_dtype(Kind::Uint8)
    } else {
        tensor.shallow_clone()
    }
}

impl Communicator for Gloo {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn agree(&mut self, identity: &Identity) -> Result<(), CommError> {
        agree_with_joined(self.rank, &self.identity, identity)
    }

    fn run(
        &mut self,
        site: &Site,
        collective: &Collective,
        input: &Tensor,
    ) -> Result<Tensor, CommError> {
        let input = input.contiguous();
        let rows = input.size().first().copied().unwrap_or(1);
        let world = self.world as i64;
        match collective {
            Collective::AllToAll {
                output_splits,
                input_splits,
            } => {
                check_input_splits(site, input_splits, rows)?;
                let output = empty_rows(&input, output_splits.iter().sum());
                let (send, recv) = (movable(&input), movable(&output));
                self.collective(site, |group| {
                    group.all_to_all(&recv, &send, output_splits, input_splits)
                })?;
                Ok(output)
            }
            Collective::AllGather => {
                let output = empty_rows(&input, rows * world);
                let (send, recv) = (movable(&input), movable(&output));
                self.collective(site, |group| group.all_gather(&recv, &send))?;
                Ok(output)
            }
            Collective::AllReduce(op) => {
                let output = input.copy();
                self.collective(site, |group| group.all_reduce(&output, reduction(*op)))?;
                Ok(finish_reduction(output, *op, self.world))
            }
            Collective::ReduceScatter(op) => {
                if rows % world != 0 {
                    return Err(CommError::invalid(
                        site,
                        format!("{rows} rows do not split evenly over {world} ranks"),
                    ));
                }
                // An all-reduce of a copy, then this rank's block: what ProcessGroupGloo's
                // own reduce-scatter does, but its work completes only inside `wait` (it
                // cannot be polled against the hub) and it always sums, whatever the op.
                let reduced = input.copy();
                self.collective(site, |group| group.all_reduce(&reduced, reduction(*op)))?;
                let share = rows / world;
                let block = reduced.narrow(0, self.rank as i64 * share, share).copy();
                Ok(finish_reduction(block, *op, self.world))
            }
        }
    }

    fn abort(&mut self, message: &str) {
        self.coordinator.abort(message);
    }

    fn finish(&mut self) -> Result<(), CommError> {
        if let Some(error) = self.coordinator.aborted() {
            return Err(error);
        }
        self.coordinator.done();
        Ok(())
    }
}
