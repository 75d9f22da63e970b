//! Random ops draw from a generator stream of their own rank, and replay reproduces forward.
//!
//! libtorch's random kernels draw from the device's default generator, which every thread of
//! the process shares. Each rank keeps its own generator state and swaps it in around each
//! random op, under one process-wide lock, so loopback ranks draw from independent,
//! deterministic streams whatever the threads' interleaving. Forward records the state each
//! random op started from; replay runs the op from that state and leaves the rank's stream
//! where it was, so the replayed result is the forward one, bit for bit, and later random ops
//! draw exactly what they would have without checkpointing.

use std::{collections::HashMap, sync::Mutex};

use ir::{plan::Stage, NodeId};
use tch::{Device, Tensor};

use crate::ffi;

/// Serialises every swap of the default generators' states.
static GENERATORS: Mutex<()> = Mutex::new(());

/// One rank's generator stream and the states its random ops started from in forward.
pub struct RankRng {
    device: Device,
    state: Tensor,
    forward: HashMap<NodeId, Tensor>,
}

impl RankRng {
    /// A stream starting from `state` (a state of `device`'s default generator).
    fn from_state(device: Device, state: Tensor) -> RankRng {
        RankRng {
            device,
            state,
            forward: HashMap::new(),
        }
    }

    /// A stream starting where the default generator of `device` seeded with `seed` would.
    pub fn seeded(device: Device, seed: u64) -> Result<RankRng, String> {
        let _guard = GENERATORS.lock().unwrap_or_else(|p| p.into_inner());
        Ok(RankRng::from_state(
            device,
            ffi::seeded_rng_state(device, seed)?,
        ))
    }

    /// Runs the random op `node` of `stage` with this rank's generator state: in forward from
    /// the stream (remembering where it started), in replay from where forward started it.
    pub fn run<R>(
        &mut self,
        stage: Stage,
        node: NodeId,
        op: impl FnOnce() -> Result<R, String>,
    ) -> Result<R, String> {
        let _guard = GENERATORS.lock().unwrap_or_else(|p| p.into_inner());
        let outside = ffi::rng_state(self.device)?;
        let start = match stage {
            Stage::Replay => self
                .forward
                .get(&node)
                .ok_or("replay runs a random op that forward did not run")?,
            Stage::Forward | Stage::Backward => &self.state,
        };
        ffi::set_rng_state(self.device, start)?;
        if stage == Stage::Forward {
            self.forward.insert(node, self.state.copy());
        }
        let result = op();
        if stage != Stage::Replay {
            self.state = ffi::rng_state(self.device)?;
        }
        ffi::set_rng_state(self.device, &outside)?;
        result
    }
}
