//! NCCL ranks, one per GPU, through the torch wheel's own libnccl ([`libnccl`], loaded at run
//! time, so this builds and links without CUDA).
//!
//! Ranks meet at rank 0's [`Hub`] (the TCP rendezvous): it checks that they all run the same
//! graph and plan and hands out the NCCL unique id; its connections then carry arrivals and
//! aborts. Collectives are queued on the stream ATen runs its kernels on (all-to-all as
//! grouped send/recv), so they order with the ops around them without host synchronisation.
//! A watchdog thread follows each queued collective with a CUDA event: one that does not
//! complete within the timeout is reported to the hub, which names the rank that never reached
//! it and aborts every rank; the watchdog then aborts the NCCL communicator, so kernels stuck
//! waiting for a peer return and no rank hangs.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    thread,
    time::{Duration, Instant},
};

use tch::{Device, Kind, Tensor};

use super::{
    agree_with_joined, check_input_splits,
    libnccl::{self, Comm, DataType, RedOp, Status, Stream, UniqueId},
    offsets,
    rendezvous::{Coordinator, Hub},
    rows_like, CommError, Communicator, Identity, ReduceOp, Site,
};
use crate::{ffi, program::Collective};

/// How often the watchdog looks at a pending collective.
const POLL: Duration = Duration::from_micros(200);

/// Whether libnccl can be loaded.
pub fn available() -> bool {
    libnccl::nccl().is_ok()
}

fn lib() -> Result<&'static libnccl::Nccl, CommError> {
    libnccl::nccl().map_err(CommError::Transport)
}

/// `Ok` for NCCL's success, else an error naming the call.
fn called(what: &str, status: Status) -> Result<(), CommError> {
    if status == libnccl::SUCCESS {
        return Ok(());
    }
    let why = lib().map_or_else(|_| format!("NCCL error {status}"), |n| n.describe(status));
    Err(CommError::Transport(format!("NCCL {what} failed: {why}")))
}

/// The NCCL unique id rank 0 hands out through the hub.
pub fn unique_id() -> Result<Vec<u8>, CommError> {
    let nccl = lib()?;
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: NCCL writes the id.
    called("ncclGetUniqueId", unsafe { (nccl.get_unique_id)(&mut id) })?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// Starts rank 0's hub for `world` ranks on `address`.
pub fn host(address: SocketAddr, world: usize, timeout: Duration) -> Result<Hub, CommError> {
    Hub::start(address, world, unique_id()?, timeout)
}

/// An NCCL communicator handle, aborted at most once.
struct RawComm {
    comm: Comm,
    aborted: AtomicBool,
}

// SAFETY: NCCL allows ncclCommAbort and ncclCommGetAsyncError from another thread than the
// one queuing collectives; everything else is called by the rank's own thread.
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

impl RawComm {
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            if let Ok(nccl) = lib() {
                // SAFETY: a live communicator, aborted once.
                let _ = unsafe { (nccl.comm_abort)(self.comm) };
            }
        }
    }

    /// An error NCCL hit asynchronously (a peer failed), if any.
    fn async_error(&self) -> Option<String> {
        let nccl = lib().ok()?;
        let mut state = libnccl::SUCCESS;
        // SAFETY: a live communicator; NCCL writes the state.
        unsafe { (nccl.comm_get_async_error)(self.comm, &mut state) };
        (state != libnccl::SUCCESS && state != libnccl::IN_PROGRESS).then(|| nccl.describe(state))
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) {
            if let Ok(nccl) = lib() {
                // SAFETY: a live communicator, destroyed once.
                let _ = unsafe { (nccl.comm_destroy)(self.comm) };
            }
        }
    }
}

/// A queued collective the watchdog follows.
struct Pending {
    event: ffi::Event,
    seq: u64,
    site: String,
}

/// One rank's NCCL communicator.
pub struct Nccl {
    rank: usize,
    world: usize,
    device: Device,
    identity: Identity,
    comm: Arc<RawComm>,
    coordinator: Arc<Coordinator>,
    pending: Option<mpsc::Sender<Pending>>,
    watchdog: Option<thread::JoinHandle<()>>,
}

impl Nccl {
    /// Joins the rendezvous at `hub` as `rank` of `world` on `device`, then creates the NCCL
    /// communicator (bounded by the timeout, like everything else).
    pub fn connect(
        hub: SocketAddr,
        rank: usize,
        world: usize,
        device: Device,
        identity: Identity,
        timeout: Duration,
    ) -> Result<Nccl, CommError> {
        lib()?;
        let (coordinator, id) = Coordinator::join(hub, rank, world, &identity, timeout)?;
        let coordinator = Arc::new(coordinator);
        let comm = init(rank, world, device, &id, timeout).inspect_err(|e| {
            coordinator.abort(&e.to_string());
        })?;
        let comm = Arc::new(comm);
        let (pending, queue) = mpsc::channel();
        let watchdog = {
            let comm = Arc::clone(&comm);
            let coordinator = Arc::clone(&coordinator);
            thread::Builder::new()
                .name(format!("nccl-watchdog-{rank}"))
                .spawn(move || watch(&queue, &comm, &coordinator))
                .map_err(|e| CommError::Transport(format!("cannot start the watchdog: {e}")))?
        };
        Ok(Nccl {
            rank,
            world,
            device,
            identity,
            comm,
            coordinator,
            pending: Some(pending),
            watchdog: Some(watchdog),
        })
    }

    fn stream(&self) -> Result<Stream, CommError> {
        ffi::current_stream(self.device)
            .map(|s| s.cast())
            .map_err(CommError::Transport)
    }

    /// Queues `enqueue` as one NCCL group on the ops' stream and hands it to the watchdog.
    fn queue(
        &self,
        site: &Site,
        enqueue: impl FnOnce(&libnccl::Nccl, Comm, Stream) -> Status,
    ) -> Result<(), CommError> {
        if let Some(error) = self.coordinator.aborted() {
            return Err(error);
        }
        self.coordinator.arrive(site.seq);
        let nccl = lib()?;
        let stream = self.stream()?;
        // SAFETY: group calls bracket the enqueued operations.
        called("ncclGroupStart", unsafe { (nccl.group_start)() })?;
        let queued = enqueue(nccl, self.comm.comm, stream);
        // SAFETY: as above.
        called("ncclGroupEnd", unsafe { (nccl.group_end)() })?;
        called(site.op, queued)?;
        let event = ffi::Event::record(self.device).map_err(CommError::Transport)?;
        let pending = Pending {
            event,
            seq: site.seq,
            site: site.to_string(),
        };
        if let Some(sender) = &self.pending {
            // The watchdog only stops when dropped; a send cannot fail before.
            let _ = sender.send(pending);
        }
        Ok(())
    }
}

/// Creates the communicator on a helper thread: ncclCommInitRank blocks until every rank
/// calls it, and a rank that died after the rendezvous must not hang this one.
fn init(
    rank: usize,
    world: usize,
    device: Device,
    id: &[u8],
    timeout: Duration,
) -> Result<RawComm, CommError> {
    let nccl = lib()?;
    let mut unique = UniqueId { internal: [0; 128] };
    for (slot, byte) in unique.internal.iter_mut().zip(id) {
        *slot = *byte as std::ffi::c_char;
    }
    let (sender, receiver) = mpsc::channel();
    thread::Builder::new()
        .name(format!("nccl-init-{rank}"))
        .spawn(move || {
            let made = ffi::set_device(device)
                .map_err(CommError::Transport)
                .and_then(|()| {
                    let mut comm = std::ptr::null_mut();
                    let (world, rank) = (world as i32, rank as i32);
                    // SAFETY: NCCL writes the communicator on success.
                    let status = unsafe { (nccl.comm_init_rank)(&mut comm, world, unique, rank) };
                    called("ncclCommInitRank", status)?;
                    Ok(comm as usize)
                });
            let _ = sender.send(made);
        })
        .map_err(|e| CommError::Transport(format!("cannot start NCCL's init: {e}")))?;
    let comm = receiver.recv_timeout(timeout).map_err(|_| {
        CommError::Transport(format!(
            "NCCL's communicator did not form within {} s (a rank died after the rendezvous)",
            timeout.as_secs_f64()
        ))
    })??;
    Ok(RawComm {
        comm: comm as Comm,
        aborted: AtomicBool::new(false),
    })
}

/// The watchdog: follows each queued collective until it completes; on a timeout, an NCCL
/// error or the hub's abort, it aborts the communicator.
fn watch(queue: &mpsc::Receiver<Pending>, comm: &RawComm, coordinator: &Coordinator) {
    let timeout = coordinator.timeout();
    loop {
        let pending = match queue.recv_timeout(POLL * 50) {
            Ok(p) => p,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if coordinator.aborted().is_some() {
                    comm.abort();
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let deadline = Instant::now() + timeout;
        loop {
            match pending.event.done() {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    coordinator.abort(&format!("{}: {e}", pending.site));
                    comm.abort();
                    return;
                }
            }
            if let Some(state) = comm.async_error() {
                coordinator.abort(&format!("{}: NCCL error {state}", pending.site));
                comm.abort();
                return;
            }
            if coordinator.aborted().is_some() {
                comm.abort();
                return;
            }
            if Instant::now() >= deadline {
                coordinator.timed_out(pending.seq, &pending.site);
                // The hub answers with an abort naming the rank at fault; abort either way.
                coordinator.wait_aborted(timeout);
                comm.abort();
                return;
            }
            thread::sleep(POLL);
        }
    }
}

fn nccl_type(kind: Kind) -> Option<DataType> {
    use DataType as T;
    Some(match kind {
        Kind::Float => T::Float32,
        Kind::Double => T::Float64,
        Kind::Half => T::Float16,
        Kind::BFloat16 => T::Bfloat16,
        Kind::Int64 => T::Int64,
        Kind::Int => T::Int32,
        Kind::Int8 => T::Int8,
        Kind::Uint8 => T::Uint8,
        Kind::Float8e4m3fn => T::Float8e4m3,
        Kind::Float8e5m2 => T::Float8e5m2,
        _ => return None,
    })
}

/// For data movement any element type moves as its bytes.
fn moved_type(kind: Kind) -> (DataType, usize) {
    match nccl_type(kind) {
        Some(t) if kind != Kind::Bool => (t, 1),
        _ => (DataType::Uint8, kind.elt_size_in_bytes()),
    }
}

fn reduce_op(op: ReduceOp) -> RedOp {
    match op {
        ReduceOp::Sum => RedOp::Sum,
        ReduceOp::Avg => RedOp::Avg,
        ReduceOp::Max => RedOp::Max,
        ReduceOp::Min => RedOp::Min,
        ReduceOp::Product => RedOp::Prod,
    }
}

impl Communicator for Nccl {
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
        let kind = input.kind();
        let rows = input.size().first().copied().unwrap_or(1);
        let numel = input.numel();
        let world = self.world as i64;
        let send = input.data_ptr() as *const std::ffi::c_void;
        match collective {
            Collective::AllToAll {
                output_splits,
                input_splits,
            } => {
                check_input_splits(site, input_splits, rows)?;
                let output = Tensor::empty(
                    rows_like(&input, output_splits.iter().sum()),
                    (kind, self.device),
                );
                let row = if rows == 0 { 0 } else { numel / rows as usize };
                let (dtype, scale) = moved_type(kind);
                let elt = kind.elt_size_in_bytes();
                let recv = output.data_ptr() as *mut u8;
                self.queue(site, |nccl, comm, stream| {
                    let (sends, recvs) = (offsets(input_splits), offsets(output_splits));
                    for peer in 0..input_splits.len() {
                        let count = |n: i64| n as usize * row * scale;
                        let byte = |at: i64| at as usize * row * elt;
                        // SAFETY: offsets lie inside the contiguous buffers, sized from the
                        // same splits; both live until the queued work completes (the stream
                        // orders their reuse).
                        let statuses = unsafe {
                            [
                                (nccl.send)(
                                    (send as *const u8).add(byte(sends[peer])).cast(),
                                    count(input_splits[peer]),
                                    dtype,
                                    peer as i32,
                                    comm,
                                    stream,
                                ),
                                (nccl.recv)(
                                    recv.add(byte(recvs[peer])).cast(),
                                    count(output_splits[peer]),
                                    dtype,
                                    peer as i32,
                                    comm,
                                    stream,
                                ),
                            ]
                        };
                        if let Some(&failed) = statuses.iter().find(|&&s| s != libnccl::SUCCESS) {
                            return failed;
                        }
                    }
                    libnccl::SUCCESS
                })?;
                Ok(output)
            }
            Collective::AllGather => {
                let output = Tensor::empty(rows_like(&input, rows * world), (kind, self.device));
                let (dtype, scale) = moved_type(kind);
                let recv = output.data_ptr();
                self.queue(site, |nccl, comm, stream| {
                    // SAFETY: the output holds `world` times the input.
                    unsafe { (nccl.all_gather)(send, recv, numel * scale, dtype, comm, stream) }
                })?;
                Ok(output)
            }
            Collective::ReduceScatter(op) | Collective::AllReduce(op) => {
                let dtype = nccl_type(kind).ok_or_else(|| {
                    CommError::invalid(site, format!("NCCL cannot reduce {kind:?}"))
                })?;
                let scatter = matches!(collective, Collective::ReduceScatter(_));
                if scatter && rows % world != 0 {
                    return Err(CommError::invalid(
                        site,
                        format!("{rows} rows do not split evenly over {world} ranks"),
                    ));
                }
                let out_rows = if scatter { rows / world } else { rows };
                let output = Tensor::empty(rows_like(&input, out_rows), (kind, self.device));
                let recv = output.data_ptr();
                let op = reduce_op(*op);
                self.queue(site, |nccl, comm, stream| {
                    // SAFETY: buffers sized for the collective.
                    unsafe {
                        if scatter {
                            (nccl.reduce_scatter)(
                                send,
                                recv,
                                output.numel(),
                                dtype,
                                op,
                                comm,
                                stream,
                            )
                        } else {
                            (nccl.all_reduce)(send, recv, numel, dtype, op, comm, stream)
                        }
                    }
                })?;
                Ok(output)
            }
        }
    }

    fn abort(&mut self, message: &str) {
        self.coordinator.abort(message);
        self.comm.abort();
    }

    fn finish(&mut self) -> Result<(), CommError> {
        // Dropping the queue lets the watchdog return once every collective completed.
        self.pending.take();
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
        if let Some(error) = self.coordinator.aborted() {
            return Err(error);
        }
        self.coordinator.done();
        Ok(())
    }
}
