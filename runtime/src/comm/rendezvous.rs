//! The TCP rendezvous and control channel of ranks that do not share memory (NCCL ranks, one
//! per GPU, in one process or across processes and hosts; gloo ranks, one per process).
//!
//! Rank 0 hosts a hub; every rank (rank 0 too) connects to it and says who it is and what it
//! runs (`HELLO rank world structure plan`). Once all have, the hub either refuses (the ranks
//! hold different graphs or plans: every rank gets both fingerprints) or hands every rank the
//! same communicator id (the NCCL unique id) and the connections stay open as a control
//! channel: ranks announce each collective they reach (`ARRIVE seq`), report a collective that
//! did not complete in time (`TIMEOUT seq site`), a failure of their own (`ABORT message`) or
//! success (`DONE`). The hub turns the first problem into one abort it sends every rank, naming
//! the rank at fault: the one that failed, the one that never reached the collective the others
//! wait in, or the one whose connection dropped (its process died).
//!
//! Lines are text; fields are separated by single spaces and the last field of a line may
//! hold spaces.

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs},
    sync::{mpsc, Arc, Condvar, Mutex},
    thread,
    time::{Duration, Instant},
};

use super::{CommError, Identity};

/// How long a rank keeps trying to reach the hub, and between tries.
const RETRY: Duration = Duration::from_millis(50);

/// One rank's end of the control channel.
pub struct Coordinator {
    rank: usize,
    writer: Mutex<TcpStream>,
    abort: Arc<AbortFlag>,
    timeout: Duration,
}

/// The abort the hub sent, once it has.
#[derive(Default)]
struct AbortFlag {
    error: Mutex<Option<CommError>>,
    set: Condvar,
}

impl AbortFlag {
    fn raise(&self, error: CommError) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(error);
        self.set.notify_all();
    }

    fn get(&self) -> Option<CommError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Where the hub listens and what it gives every rank.
pub struct Hub {
    pub address: SocketAddr,
    /// Disconnected once the hub has stopped serving.
    stopped: mpsc::Receiver<()>,
}

impl Hub {
    /// Starts rank 0's hub on `address` (port 0 picks a free one) for `world` ranks; `id` is
    /// what every rank receives once they agree (the NCCL unique id).
    pub fn start(
        address: impl ToSocketAddrs,
        world: usize,
        id: Vec<u8>,
        timeout: Duration,
    ) -> Result<Hub, CommError> {
        let listener = TcpListener::bind(address)
            .map_err(|e| CommError::Transport(format!("rendezvous: cannot listen: {e}")))?;
        let address = listener
            .local_addr()
            .map_err(|e| CommError::Transport(format!("rendezvous: {e}")))?;
        let (serving, stopped) = mpsc::channel::<()>();
        thread::Builder::new()
            .name("rendezvous-hub".to_owned())
            .spawn(move || {
                serve(listener, world, &id, timeout);
                drop(serving);
            })
            .map_err(|e| CommError::Transport(format!("rendezvous: cannot start the hub: {e}")))?;
        Ok(Hub { address, stopped })
    }

    /// Waits up to `limit` for the hub to stop: every rank said it is done or left (or the
    /// rendezvous failed). The process that hosts the hub outlives it, so that every rank
    /// hears of an abort and none loses the hub while it still runs.
    pub fn wait_stopped(&self, limit: Duration) {
        let _ = self.stopped.recv_timeout(limit);
    }
}

impl Coordinator {
    /// Joins the rendezvous at `hub` as `rank` of `world`: returns the control channel and the
    /// id the hub hands out, or the reason the ranks cannot run together.
    pub fn join(
        hub: SocketAddr,
        rank: usize,
        world: usize,
        identity: &Identity,
        timeout: Duration,
    ) -> Result<(Coordinator, Vec<u8>), CommError> {
        let stream = connect(hub, timeout)?;
        let transport = |e: std::io::Error| CommError::Transport(format!("rendezvous: {e}"));
        let mut writer = stream.try_clone().map_err(transport)?;
        writeln!(
            writer,
            "HELLO {rank} {world} {} {}",
            identity.structure, identity.plan
        )
        .map_err(transport)?;
        // The hub answers within the timeout, or tells why not; wait a little longer than it.
        stream
            .set_read_timeout(Some(timeout * 2))
            .map_err(transport)?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).map_err(|e| {
            CommError::Transport(format!("rendezvous: no answer from rank 0's hub: {e}"))
        })?;
        // The id is empty for communicators that need none (gloo): `WELCOME` alone.
        let answer = line.trim_end();
        let id = match answer.split_once(' ').unwrap_or((answer, "")) {
            ("WELCOME", hex) => from_hex(hex)?,
            ("MISMATCH", rest) => return Err(mismatch(rank, identity, rest)),
            ("ABORT", rest) => return Err(parse_abort(rest)),
            _ => {
                return Err(CommError::Transport(format!(
                    "rendezvous: unexpected answer `{}`",
                    line.trim_end()
                )))
            }
        };
        reader.get_ref().set_read_timeout(None).map_err(transport)?;
        let abort = Arc::new(AbortFlag::default());
        let flag = Arc::clone(&abort);
        thread::Builder::new()
            .name(format!("rendezvous-rank-{rank}"))
            .spawn(move || listen(reader, &flag))
            .map_err(|e| CommError::Transport(format!("rendezvous: {e}")))?;
        let coordinator = Coordinator {
            rank,
            writer: Mutex::new(writer),
            abort,
            timeout,
        };
        Ok((coordinator, id))
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn send(&self, line: &str) {
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        // A hub that is gone has already aborted everyone (or the run is over).
        let _ = writeln!(writer, "{}", line.replace('\n', " "));
    }

    /// This rank reached collective `seq`.
    pub fn arrive(&self, seq: u64) {
        self.send(&format!("ARRIVE {seq}"));
    }

    /// Collective `seq` (`site` describes it) did not complete within the timeout here.
    pub fn timed_out(&self, seq: u64, site: &str) {
        self.send(&format!("TIMEOUT {seq} {site}"));
    }

    /// This rank failed: every rank is aborted, naming it. Returns once the hub relayed the
    /// abort (back to this rank too), or after the timeout: a process that exits right after
    /// has told the others first.
    pub fn abort(&self, message: &str) {
        self.send(&format!("ABORT {message}"));
        self.wait_aborted(self.timeout);
    }

    /// This rank finished its work.
    pub fn done(&self) {
        self.send("DONE");
    }

    /// The abort the hub sent, if any.
    pub fn aborted(&self) -> Option<CommError> {
        self.abort.get()
    }

    /// Waits up to `limit` for the hub's abort.
    pub fn wait_aborted(&self, limit: Duration) -> Option<CommError> {
        let deadline = Instant::now() + limit;
        let mut slot = self.abort.error.lock().unwrap_or_else(|p| p.into_inner());
        while slot.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            slot = self
                .abort
                .set
                .wait_timeout(slot, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        slot.clone()
    }
}

impl Drop for Coordinator {
    /// Closes the connection (the listening thread holds a clone of it): the hub learns that
    /// this rank is gone, which is an abort unless it said `DONE` first.
    fn drop(&mut self) {
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writer.shutdown(std::net::Shutdown::Both);
    }
}

fn connect(hub: SocketAddr, timeout: Duration) -> Result<TcpStream, CommError> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect_timeout(&hub, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() >= deadline => {
                return Err(CommError::Transport(format!(
                    "rendezvous: cannot reach rank 0 at {hub} within {} s: {e}",
                    timeout.as_secs_f64()
                )))
            }
            Err(_) => thread::sleep(RETRY),
        }
    }
}

/// Reads the hub's lines until it closes; the first abort is raised.
fn listen(reader: BufReader<TcpStream>, flag: &AbortFlag) {
    for line in reader.lines() {
        match line {
            Ok(line) => {
                if let Some(rest) = line.strip_prefix("ABORT ") {
                    flag.raise(parse_abort(rest));
                }
            }
            Err(e) => {
                flag.raise(CommError::Transport(format!(
                    "lost the connection to rank 0's hub: {e}"
                )));
                return;
            }
        }
    }
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(text: &str) -> Result<Vec<u8>, CommError> {
    let bad = || CommError::Transport("rendezvous: malformed id from the hub".to_owned());
    if text.len() % 2 != 0 {
        return Err(bad());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2).ok_or_else(bad)?, 16).map_err(|_| bad()))
        .collect()
}

/// `MISMATCH r0_structure r0_plan rank structure plan` seen by rank `me`.
fn mismatch(me: usize, mine: &Identity, rest: &str) -> CommError {
    let fields: Vec<&str> = rest.split(' ').collect();
    let identity = |s: &str, p: &str| Identity {
        structure: s.to_owned(),
        plan: p.to_owned(),
    };
    match fields.as_slice() {
        [s0, p0, rank, s, p] => {
            let rank: usize = rank.parse().unwrap_or(usize::MAX);
            // Compare against whichever of the two differs from this rank.
            let (other, theirs) = if rank == me {
                (0, identity(s0, p0))
            } else {
                (rank, identity(s, p))
            };
            CommError::Mismatch {
                me,
                mine: mine.describe(),
                rank: other,
                theirs: theirs.describe(),
            }
        }
        _ => CommError::Transport(format!("rendezvous: malformed mismatch `{rest}`")),
    }
}

/// `STALLED rank seconds site`, `FAILED rank message`, `LOST rank`, `INCOMPLETE rank seconds site`.
fn parse_abort(rest: &str) -> CommError {
    let mut fields = rest.splitn(4, ' ');
    let kind = fields.next().unwrap_or("");
    let rank: usize = fields
        .next()
        .and_then(|r| r.parse().ok())
        .unwrap_or(usize::MAX);
    match kind {
        "STALLED" => {
            let seconds = fields.next().and_then(|s| s.parse().ok()).unwrap_or(0.0);
            CommError::Stalled {
                rank,
                site: fields.next().unwrap_or("").to_owned(),
                seconds,
            }
        }
        "FAILED" => {
            let rest: Vec<&str> = fields.collect();
            CommError::RankFailed {
                rank,
                message: rest.join(" "),
            }
        }
        "LOST" => CommError::Transport(format!(
            "rank {rank} exited before finishing (its connection to the hub dropped)"
        )),
        "INCOMPLETE" => {
            let seconds = fields.next().unwrap_or("?");
            let site = fields.next().unwrap_or("");
            CommError::Transport(format!(
                "{site} did not complete within {seconds} s on rank {rank}, though every rank reached it"
            ))
        }
        _ => CommError::Transport(format!("aborted by the hub: {rest}")),
    }
}

/// What one rank told the hub.
enum Event {
    Line(usize, String),
    Closed(usize),
}

/// The hub: the rendezvous, then relaying aborts until every rank is done or gone.
fn serve(listener: TcpListener, world: usize, id: &[u8], timeout: Duration) {
    let Some(mut ranks) = gather(&listener, world, timeout) else {
        return;
    };
    let Some(first) = ranks.first().map(|r| r.identity.clone()) else {
        return;
    };
    let differing = ranks.iter().find(|r| r.identity != first);
    let answer = match differing {
        Some(other) => format!(
            "MISMATCH {} {} {} {} {}",
            first.structure, first.plan, other.rank, other.identity.structure, other.identity.plan
        ),
        None => format!("WELCOME {}", to_hex(id)),
    };
    let refused = differing.is_some();
    for r in &mut ranks {
        let _ = writeln!(r.stream, "{answer}");
    }
    if refused {
        return;
    }
    relay(ranks, timeout);
}

struct Joined {
    rank: usize,
    identity: Identity,
    stream: TcpStream,
    reader: BufReader<TcpStream>,
}

/// Accepts every rank's HELLO, ordered by rank; `None` when they do not all come in time or
/// disagree on the world size (each connected rank is told).
fn gather(listener: &TcpListener, world: usize, timeout: Duration) -> Option<Vec<Joined>> {
    let deadline = Instant::now() + timeout;
    let mut joined: Vec<Joined> = Vec::with_capacity(world);
    listener.set_nonblocking(true).ok()?;
    while joined.len() < world {
        if Instant::now() >= deadline {
            let missing: Vec<String> = (0..world)
                .filter(|r| !joined.iter().any(|j| j.rank == *r))
                .map(|r| r.to_string())
                .collect();
            let line = format!(
                "ABORT STALLED {} {} the rendezvous (ranks missing: {})",
                missing.first().map_or("?", String::as_str),
                timeout.as_secs_f64(),
                missing.join(", ")
            );
            for j in &mut joined {
                let _ = writeln!(j.stream, "{line}");
            }
            return None;
        }
        let Ok((stream, _)) = listener.accept() else {
            thread::sleep(RETRY);
            continue;
        };
        if let Some(j) = hello(stream, world, deadline) {
            joined.retain(|other| other.rank != j.rank);
            joined.push(j);
        }
    }
    joined.sort_by_key(|j| j.rank);
    Some(joined)
}

/// Reads one rank's `HELLO rank world structure plan`.
fn hello(stream: TcpStream, world: usize, deadline: Instant) -> Option<Joined> {
    stream.set_nonblocking(false).ok()?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(RETRY);
    stream.set_read_timeout(Some(left)).ok()?;
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let fields: Vec<&str> = line.trim_end().split(' ').collect();
    let ["HELLO", rank, their_world, structure, plan] = fields.as_slice() else {
        return None;
    };
    let rank: usize = rank.parse().ok()?;
    let mut stream = stream;
    if their_world.parse::<usize>().ok()? != world || rank >= world {
        let _ = writeln!(
            stream,
            "ABORT FAILED {rank} joined as rank {rank} of {their_world}, but the hub runs {world} ranks"
        );
        return None;
    }
    stream.set_read_timeout(None).ok()?;
    reader.get_ref().set_read_timeout(None).ok()?;
    Some(Joined {
        rank,
        identity: Identity {
            structure: (*structure).to_owned(),
            plan: (*plan).to_owned(),
        },
        stream,
        reader,
    })
}

/// Passes one rank's lines to the hub until its connection closes.
fn forward_lines(rank: usize, reader: BufReader<TcpStream>, events: &mpsc::Sender<Event>) {
    for line in reader.lines() {
        let Ok(line) = line else { break };
        if events.send(Event::Line(rank, line)).is_err() {
            return;
        }
    }
    let _ = events.send(Event::Closed(rank));
}

/// After the rendezvous: tracks arrivals and turns the first problem into one abort for all.
fn relay(ranks: Vec<Joined>, timeout: Duration) {
    let world = ranks.len();
    let (events, inbox) = mpsc::channel();
    let mut streams = Vec::with_capacity(world);
    for j in ranks {
        let rank = j.rank;
        let reader = j.reader;
        streams.push(j.stream);
        let sender = events.clone();
        let spawned = thread::Builder::new()
            .name(format!("rendezvous-hub-{rank}"))
            .spawn(move || forward_lines(rank, reader, &sender));
        if spawned.is_err() {
            let _ = events.send(Event::Closed(rank));
        }
    }
    drop(events);
    // Collectives each rank has reached (one past the highest `seq`).
    let mut reached = vec![0u64; world];
    let mut done = vec![false; world];
    let mut aborted = false;
    while let Ok(event) = inbox.recv() {
        let abort = match event {
            Event::Closed(rank) if !done[rank] => Some(format!("LOST {rank}")),
            Event::Closed(_) => None,
            Event::Line(rank, line) => {
                let (kind, rest) = line.split_once(' ').unwrap_or((line.as_str(), ""));
                match kind {
                    "ARRIVE" => {
                        if let Ok(seq) = rest.parse::<u64>() {
                            reached[rank] = reached[rank].max(seq + 1);
                        }
                        None
                    }
                    "DONE" => {
                        done[rank] = true;
                        None
                    }
                    "ABORT" => Some(format!("FAILED {rank} {rest}")),
                    "TIMEOUT" => {
                        let (seq, site) = rest.split_once(' ').unwrap_or((rest, ""));
                        let seq: u64 = seq.parse().unwrap_or(0);
                        let seconds = timeout.as_secs_f64();
                        Some(match reached.iter().position(|&r| r <= seq) {
                            Some(stalled) => format!("STALLED {stalled} {seconds} {site}"),
                            None => format!("INCOMPLETE {rank} {seconds} {site}"),
                        })
                    }
                    _ => None,
                }
            }
        };
        if let Some(abort) = abort.filter(|_| !aborted) {
            aborted = true;
            for stream in &mut streams {
                let _ = writeln!(stream, "ABORT {abort}");
            }
        }
        if done.iter().all(|&d| d) {
            return;
        }
    }
}
