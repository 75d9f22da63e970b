//! Measured memory: the bytes of the storages the runtime holds, counted once per storage.
//!
//! Every live tensor (value copy) the executor holds is registered by its storage; a view or
//! an alias shares its base's storage and adds nothing; a storage counts until the last tensor
//! holding it is released. Parameters (and views of them) are resident for the whole step and
//! counted apart, as the planner's prediction does. The peak is sampled after each step's
//! outputs exist and before its last-used inputs are freed, the instant the planner's liveness
//! simulation counts.

use std::collections::{HashMap, HashSet};

use tch::Tensor;

use crate::ffi;

#[derive(Debug, Default)]
pub struct LiveBytes {
    /// Storage -> (tensors holding it, bytes).
    held: HashMap<usize, (u32, u64)>,
    /// Storages of parameters: never counted.
    resident: HashSet<usize>,
    live: u64,
    peak: u64,
}

impl LiveBytes {
    /// Marks `tensor`'s storage as resident (a parameter's): never counted.
    pub fn resident(&mut self, tensor: &Tensor) {
        if let Some((key, _)) = ffi::storage(tensor) {
            self.resident.insert(key);
        }
    }

    /// The runtime now holds `tensor`.
    pub fn hold(&mut self, tensor: &Tensor) {
        let Some((key, bytes)) = ffi::storage(tensor) else {
            return;
        };
        if self.resident.contains(&key) {
            return;
        }
        let entry = self.held.entry(key).or_insert((0, bytes));
        if entry.0 == 0 {
            self.live += entry.1;
        }
        entry.0 += 1;
    }

    /// The runtime no longer holds `tensor`.
    pub fn release(&mut self, tensor: &Tensor) {
        let Some((key, _)) = ffi::storage(tensor) else {
            return;
        };
        if let Some(entry) = self.held.get_mut(&key) {
            entry.0 -= 1;
            if entry.0 == 0 {
                self.live -= entry.1;
                self.held.remove(&key);
            }
        }
    }

    /// Records the bytes live now as a candidate peak.
    pub fn sample(&mut self) {
        self.peak = self.peak.max(self.live);
    }

    pub fn peak(&self) -> u64 {
        self.peak
    }
}

/// Host memory of the offloaded storages: the bytes parked there now, at most during one step,
/// and moved in all (each storage once per move). A storage counts at the step its copy to
/// the host runs after, and at the step its reload runs before (the host buffer a copy fills or
/// drains exists during the step the copy goes with), as the planner counts it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HostBytes {
    live: u64,
    /// Reloaded before the step running now: in host memory until it ends.
    reloading: u64,
    pub peak: u64,
    pub moved: u64,
}

impl HostBytes {
    /// A storage of `bytes` arrived in host memory.
    pub fn park(&mut self, bytes: u64) {
        self.live += bytes;
        self.moved += bytes;
    }

    /// A storage of `bytes` went back to the device for the step about to run.
    pub fn unpark(&mut self, bytes: u64) {
        self.live -= bytes;
        self.reloading += bytes;
    }

    /// The step has run, and its copies to the host too: records the bytes it used as a
    /// candidate peak.
    pub fn sample(&mut self) {
        self.peak = self.peak.max(self.live + self.reloading);
        self.reloading = 0;
    }

    /// Bytes in host memory now.
    pub fn live(&self) -> u64 {
        self.live
    }
}

#[cfg(test)]
mod tests {
    use super::HostBytes;

    #[test]
    fn a_storage_reloaded_for_a_step_and_one_copied_after_it_share_that_steps_host_peak() {
        let mut host = HostBytes::default();
        host.park(100);
        host.sample();
        // A comes back before the step, B goes out after it: both buffers exist during it.
        host.unpark(100);
        host.park(30);
        host.sample();
        host.unpark(30);
        host.sample();
        assert_eq!((host.peak, host.moved, host.live()), (130, 130, 0));
    }
}
