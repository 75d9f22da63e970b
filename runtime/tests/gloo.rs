//! The gloo communicator (libtorch's `ProcessGroupGloo`), with ranks as threads meeting through
//! a c10d store on localhost: every collective gives what the loopback communicator gives, bit
//! for bit, including the reductions gloo has no direct form for (average, a reduce-scatter
//! under another op than sum) and element types it does not move (float8); a rank that fails
//! is named by the others.

mod common;

use common::{on_loopback_ranks, site};

use std::{
    net::TcpListener,
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use runtime::{
    comm::{
        c10d::{Store, StoreAddress},
        gloo::Gloo,
        rendezvous::Hub,
        CommError, Communicator, Identity, ReduceOp,
    },
    program::Collective,
};
use tch::{Device, Kind, Tensor};

const WORLD: usize = 3;
const TIMEOUT: Duration = Duration::from_secs(20);

fn identity() -> Identity {
    Identity {
        structure: "s".to_owned(),
        plan: "p".to_owned(),
    }
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// Runs `body(rank, communicator)` on `WORLD` threads, each a gloo rank; each rank's result.
fn on_gloo_ranks<T: Send + 'static>(
    body: impl Fn(usize, &mut dyn Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let port = free_port();
    let hub = Hub::start("127.0.0.1:0", WORLD, Vec::new(), TIMEOUT).expect("the hub starts");
    let address = hub.address;
    let body = Arc::new(body);
    let handles: Vec<_> = (0..WORLD)
        .map(|rank| {
            let body = Arc::clone(&body);
            thread::spawn(move || {
                let store = Store::open(
                    &StoreAddress {
                        host: "127.0.0.1",
                        port,
                        server: rank == 0,
                        workers: WORLD,
                        prefix: "test",
                    },
                    TIMEOUT,
                )
                .expect("the store forms");
                let mut comm = Gloo::connect(&store, address, rank, WORLD, identity(), TIMEOUT)
                    .expect("the gloo group forms");
                let result = body(rank, &mut comm);
                // Every rank keeps the store until all are done with the group.
                (result, comm, store)
            })
        })
        .collect();
    let mut ended: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("no rank panics"))
        .collect();
    for (_, comm, _) in &mut ended {
        let _ = comm.finish();
    }
    ended.into_iter().map(|(result, _, _)| result).collect()
}

/// Rank `rank`'s input: `rows` rows of 4 values that differ per rank and row, multiples of
/// 1/4 small enough that every sum is exact: any order of summing gives the same bits.
fn input(rank: usize, rows: i64, kind: Kind) -> Tensor {
    let numel = rows * 4;
    ((Tensor::arange(numel, (Kind::Float, Device::Cpu)) * 0.25 + 1.5 * rank as f64 - 2.0)
        .reshape([rows, 4]))
    .to_kind(kind)
}

/// The bytes, dtype and shape of a tensor, for bit-for-bit comparisons.
fn bits(t: &Tensor) -> (Kind, Vec<i64>, Vec<u8>) {
    let t = t.contiguous();
    let numel = t.numel();
    let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut bytes, numel);
    (t.kind(), t.size(), bytes)
}

/// The collectives both communicators run, in order, on every rank.
fn collectives(rank: usize, comm: &mut dyn Communicator) -> Vec<(Kind, Vec<i64>, Vec<u8>)> {
    let splits: [[i64; WORLD]; WORLD] = [[1, 2, 0], [3, 0, 1], [2, 2, 2]];
    let uneven = Collective::AllToAll {
        output_splits: (0..WORLD).map(|i| splits[i][rank]).collect(),
        input_splits: splits[rank].to_vec(),
    };
    let rows: i64 = splits[rank].iter().sum();
    let steps: Vec<(&'static str, Collective, Tensor)> = vec![
        ("all_to_all_single", uneven, input(rank, rows, Kind::Float)),
        (
            "all_gather_into_tensor",
            Collective::AllGather,
            input(rank, 2, Kind::Float),
        ),
        (
            "all_gather_into_tensor",
            Collective::AllGather,
            input(rank, 2, Kind::Float8e4m3fn),
        ),
        (
            "all_gather_into_tensor",
            Collective::AllGather,
            input(rank, 2, Kind::Bool),
        ),
        (
            "all_reduce",
            Collective::AllReduce(ReduceOp::Sum),
            input(rank, 2, Kind::Float),
        ),
        (
            "all_reduce",
            Collective::AllReduce(ReduceOp::Avg),
            input(rank, 2, Kind::Float),
        ),
        (
            "all_reduce",
            Collective::AllReduce(ReduceOp::Avg),
            input(rank, 2, Kind::Int64),
        ),
        (
            "reduce_scatter_tensor",
            Collective::ReduceScatter(ReduceOp::Max),
            input(rank, 6, Kind::Float),
        ),
        (
            "reduce_scatter_tensor",
            Collective::ReduceScatter(ReduceOp::Sum),
            input(rank, 3, Kind::BFloat16),
        ),
    ];
    steps
        .into_iter()
        .enumerate()
        .map(|(seq, (op, collective, tensor))| {
            let out = comm
                .run(&site(seq as u64, op), &collective, &tensor)
                .unwrap_or_else(|e| panic!("rank {rank}, {op} #{seq}: {e}"));
            bits(&out)
        })
        .collect()
}

#[test]
fn every_collective_gives_the_loopback_communicators_result_bit_for_bit() {
    let gloo = on_gloo_ranks(collectives);
    let loopback = on_loopback_ranks(WORLD, TIMEOUT, collectives);
    assert_eq!(gloo.len(), WORLD);
    for (rank, (mine, theirs)) in gloo.iter().zip(&loopback).enumerate() {
        for (step, (a, b)) in mine.iter().zip(theirs).enumerate() {
            assert_eq!(a, b, "rank {rank}, collective #{step}");
        }
    }
}

#[test]
fn a_failing_rank_is_named_by_every_other_rank() {
    let started = Instant::now();
    let results = on_gloo_ranks(|rank, comm| -> Result<(), CommError> {
        if rank == 1 {
            comm.abort("out of patience");
            return Ok(());
        }
        comm.run(
            &site(0, "all_reduce"),
            &Collective::AllReduce(ReduceOp::Sum),
            &input(rank, 1, Kind::Float),
        )
        .map(|_| ())
    });
    for rank in [0, 2] {
        assert_eq!(
            results[rank],
            Err(CommError::RankFailed {
                rank: 1,
                message: "out of patience".to_owned()
            }),
            "rank {rank}"
        );
    }
    assert!(
        started.elapsed() < TIMEOUT,
        "the abort waited for the timeout"
    );
}
