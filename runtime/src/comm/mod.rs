//! Collectives go through one interface, whatever carries the data: [`loopback`] (ranks as
//! threads of one process), [`gloo`] (CPU ranks in separate processes, through libtorch's gloo
//! process group) or [`nccl`] (one rank per GPU, across processes or hosts). Ranks in separate
//! processes meet through the launcher's store ([`launch`]) and keep a control channel to
//! rank 0's hub ([`rendezvous`]).
//!
//! Every rank first calls [`Communicator::agree`] with what it is about to run (the graph's
//! structure and the plan's fingerprint): a mismatch is an error on every rank naming both.
//! A rank that fails calls [`Communicator::abort`]; a rank waiting in a collective for longer
//! than the timeout gives up and aborts the group. Either way every rank's next (or current)
//! collective returns an error naming the rank and the collective: never a hang.

pub mod c10d;
pub mod gloo;
pub mod launch;
pub mod libnccl;
pub mod loopback;
pub mod nccl;
pub mod rendezvous;

use std::fmt;

use tch::Tensor;
use thiserror::Error;

use crate::program::Collective;

/// How a reducing collective combines the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
    Product,
}

impl ReduceOp {
    /// The spelling of `_c10d_functional`'s `reduce_op` argument (`sum`).
    pub fn from_name(name: &str) -> Option<ReduceOp> {
        match name.to_ascii_lowercase().as_str() {
            "sum" => Some(ReduceOp::Sum),
            "avg" => Some(ReduceOp::Avg),
            "max" => Some(ReduceOp::Max),
            "min" => Some(ReduceOp::Min),
            "product" | "prod" => Some(ReduceOp::Product),
            _ => None,
        }
    }
}

/// Where a collective is called: its number on this rank and the node that calls it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// Collectives this rank ran before this one.
    pub seq: u64,
    pub op: &'static str,
    pub node: String,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "collective #{} ({} at node `{}`)",
            self.seq, self.op, self.node
        )
    }
}

/// What a rank is about to run: every rank must hold the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The graph's structure (ops and wiring, not tensor contents or per-rank sizes).
    pub structure: String,
    /// The plan's decisions and schedule.
    pub plan: String,
}

impl Identity {
    /// `structure/plan`, how messages show it.
    pub fn describe(&self) -> String {
        format!("graph structure {}, plan {}", self.structure, self.plan)
    }
}

/// Why a collective, or the agreement before them, failed.
#[derive(Debug, Clone, Error, PartialEq)]
pub enum CommError {
    #[error("rank {rank} holds {theirs}, but rank {me} holds {mine}: every rank must run the same graph and plan")]
    Mismatch {
        me: usize,
        mine: String,
        rank: usize,
        theirs: String,
    },
    #[error("rank {rank} did not reach {site} within {seconds} s (stalled or hung)")]
    Stalled {
        rank: usize,
        site: String,
        seconds: f64,
    },
    #[error("rank {rank} failed: {message}")]
    RankFailed { rank: usize, message: String },
    #[error("{site}: rank {rank} runs {theirs} instead")]
    Diverged {
        site: String,
        rank: usize,
        theirs: String,
    },
    #[error("{site}: {message}")]
    Invalid { site: String, message: String },
    #[error("{0}")]
    Transport(String),
}

/// The collectives the graphs need, over the whole world.
pub trait Communicator: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Checks that every rank holds the same `identity`; called once, before the first
    /// collective. A mismatch is an error on every rank.
    fn agree(&mut self, identity: &Identity) -> Result<(), CommError>;

    /// Runs `collective` on this rank's `input` and returns this rank's result.
    fn run(
        &mut self,
        site: &Site,
        collective: &Collective,
        input: &Tensor,
    ) -> Result<Tensor, CommError>;

    /// This rank failed (`message` says why): every other rank's collectives fail from now on,
    /// naming this rank.
    fn abort(&mut self, message: &str);

    /// This rank's work is done: waits until its collectives completed and reports an abort
    /// that reached it meanwhile.
    fn finish(&mut self) -> Result<(), CommError> {
        Ok(())
    }
}

impl CommError {
    /// A collective whose arguments do not fit its input (`message` says how) at `site`.
    pub(crate) fn invalid(site: &Site, message: String) -> CommError {
        CommError::Invalid {
            site: site.to_string(),
            message,
        }
    }
}

/// `agree` for communicators whose rendezvous hub compared every rank's identity before the
/// group formed: `identity` must be the one rank `rank` joined with (`joined`).
pub(crate) fn agree_with_joined(
    rank: usize,
    joined: &Identity,
    identity: &Identity,
) -> Result<(), CommError> {
    if identity == joined {
        return Ok(());
    }
    Err(CommError::Mismatch {
        me: rank,
        mine: identity.describe(),
        rank,
        theirs: joined.describe(),
    })
}

/// An all-to-all's input split sizes must add up to the input's `rows` leading rows.
pub(crate) fn check_input_splits(
    site: &Site,
    input_splits: &[i64],
    rows: i64,
) -> Result<(), CommError> {
    if input_splits.iter().sum::<i64>() == rows {
        return Ok(());
    }
    Err(CommError::invalid(
        site,
        format!("input split sizes {input_splits:?} do not add up to the input's {rows} rows"),
    ))
}

/// The shape of `rows` leading-dimension rows of `like`'s trailing shape.
pub(crate) fn rows_like(like: &Tensor, rows: i64) -> Vec<i64> {
    let mut sizes = like.size();
    match sizes.first_mut() {
        Some(first) => *first = rows,
        None => sizes.push(rows),
    }
    sizes
}

/// The offsets of consecutive chunks of the given sizes.
pub(crate) fn offsets(sizes: &[i64]) -> Vec<i64> {
    sizes
        .iter()
        .scan(0i64, |at, &s| {
            let start = *at;
            *at += s;
            Some(start)
        })
        .collect()
}

/// A sum over `world` ranks turned into their average: divided for floating point, floor
/// divided for integers.
pub(crate) fn average(mut sum: Tensor, world: usize) -> Tensor {
    if sum.is_floating_point() {
        sum /= world as f64;
        sum
    } else {
        sum.floor_divide_scalar(world as i64)
    }
}
