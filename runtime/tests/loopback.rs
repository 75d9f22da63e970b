//! The loopback communicator: ranks as threads exchanging real tensors, and a failing, stalled
//! or hung rank, or a rank holding another plan, ends every rank with an error instead of a
//! hang.

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use common::{on_loopback_ranks, site};
use runtime::{
    comm::{CommError, ReduceOp},
    exec::{Fault, FaultKind},
    program::Collective,
    run::{run_loopback, RunError},
};
use tch::Tensor;

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.reshape([-1])).expect("f32")
}

#[test]
fn all_to_all_exchanges_uneven_splits_between_three_ranks() {
    // Rank r sends splits[r][j] rows to rank j; row k of rank r holds 100 r + k.
    let splits: [[i64; 3]; 3] = [[1, 2, 0], [3, 0, 1], [2, 2, 2]];
    let results = on_loopback_ranks(3, Duration::from_secs(10), move |rank, comm| {
        let rows: i64 = splits[rank].iter().sum();
        let input = (Tensor::arange(rows, (tch::Kind::Float, tch::Device::Cpu))
            + 100.0 * rank as f64)
            .reshape([rows, 1]);
        let collective = Collective::AllToAll {
            output_splits: (0..3).map(|i| splits[i][rank]).collect(),
            input_splits: splits[rank].to_vec(),
        };
        comm.run(&site(0, "all_to_all_single"), &collective, &input)
            .map(|t| values(&t))
    });
    let got: Vec<Vec<f32>> = results.into_iter().map(|r| r.expect("exchanged")).collect();
    assert_eq!(got[0], vec![0.0, 100.0, 101.0, 102.0, 200.0, 201.0]);
    assert_eq!(got[1], vec![1.0, 2.0, 202.0, 203.0]);
    assert_eq!(got[2], vec![103.0, 204.0, 205.0]);
}

#[test]
fn gathers_and_reductions_combine_every_rank_in_rank_order() {
    let results = on_loopback_ranks(2, Duration::from_secs(10), |rank, comm| {
        let input = Tensor::from_slice(&[1.0f32 + rank as f32, 10.0 * (rank as f32 + 1.0)]);
        let gathered = comm
            .run(
                &site(0, "all_gather_into_tensor"),
                &Collective::AllGather,
                &input,
            )
            .map(|t| values(&t));
        let summed = comm
            .run(
                &site(1, "all_reduce"),
                &Collective::AllReduce(ReduceOp::Sum),
                &input,
            )
            .map(|t| values(&t));
        let scattered = comm
            .run(
                &site(2, "reduce_scatter_tensor"),
                &Collective::ReduceScatter(ReduceOp::Max),
                &input,
            )
            .map(|t| values(&t));
        (gathered, summed, scattered)
    });
    for (rank, (gathered, summed, scattered)) in results.into_iter().enumerate() {
        assert_eq!(gathered.unwrap(), vec![1.0, 10.0, 2.0, 20.0]);
        assert_eq!(summed.unwrap(), vec![3.0, 30.0]);
        assert_eq!(scattered.unwrap(), vec![[2.0], [20.0]][rank].to_vec());
    }
}

#[test]
fn split_sizes_that_disagree_between_ranks_are_an_error_naming_both() {
    let results = on_loopback_ranks(2, Duration::from_secs(10), |rank, comm| {
        let input = Tensor::zeros([2, 1], (tch::Kind::Float, tch::Device::Cpu));
        // Rank 1 expects two rows from rank 0, which sends it one.
        let collective = Collective::AllToAll {
            output_splits: if rank == 0 { vec![1, 1] } else { vec![2, 1] },
            input_splits: vec![1, 1],
        };
        comm.run(&site(0, "all_to_all_single"), &collective, &input)
            .map(|_| ())
    });
    // Rank 0 got what it expected; rank 1 did not (rank 0's next collective then fails on
    // the abort).
    let errors: Vec<String> = results
        .into_iter()
        .filter_map(|r| r.err().map(|e| e.to_string()))
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("rank 0 sends 1 rows to rank 1, which expects 2")),
        "{errors:?}"
    );
}

#[test]
fn a_rank_that_never_arrives_is_named_by_the_others_within_the_timeout() {
    let started = Instant::now();
    let results = on_loopback_ranks(3, Duration::from_millis(300), |rank, comm| {
        if rank == 2 {
            return Ok(());
        }
        let input = Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        comm.run(
            &site(4, "all_reduce"),
            &Collective::AllReduce(ReduceOp::Sum),
            &input,
        )
        .map(|_| ())
    });
    assert!(started.elapsed() < Duration::from_secs(3));
    for result in &results[..2] {
        match result {
            Err(CommError::Stalled { rank, site, .. }) => {
                assert_eq!(*rank, 2);
                assert!(
                    site.contains("collective #4 (all_reduce at node `node4`)"),
                    "{site}"
                );
            }
            other => panic!("expected a stalled rank 2, got {other:?}"),
        }
    }
}

#[test]
fn a_failing_rank_ends_every_rank_with_an_error_naming_it() {
    let mut config = common::config(Duration::from_secs(20));
    config.fault = Some(Fault {
        rank: 1,
        before_collective: 2,
        kind: FaultKind::Fail,
    });
    let started = Instant::now();
    let err = run_loopback(common::jobs("moe_ep2", 2), &config).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "ended by the abort, not the timeout"
    );
    let RunError::Ranks(failures) = err else {
        panic!("expected rank failures, got {err}");
    };
    assert_eq!(failures.len(), 2, "{failures:?}");
    assert_eq!(
        failures[0].0, 1,
        "the failing rank is reported first: {failures:?}"
    );
    assert!(
        failures[0]
            .1
            .contains("fault injected before collective #2"),
        "{failures:?}"
    );
    assert_eq!(failures[1].0, 0);
    assert!(failures[1].1.contains("rank 1 failed"), "{failures:?}");
}

#[test]
fn a_stalled_rank_ends_every_rank_within_the_timeout_naming_it_and_the_collective() {
    // Rank 0 gives up after 1 s; rank 1 wakes at 1.4 s, inside the second the run gives the
    // others to stop, and finds the group aborted.
    let timeout = Duration::from_secs(1);
    let mut config = common::config(timeout);
    config.fault = Some(Fault {
        rank: 1,
        before_collective: 1,
        kind: FaultKind::Stall(Duration::from_millis(1400)),
    });
    let started = Instant::now();
    let err = run_loopback(common::jobs("moe_ep2", 2), &config).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    let RunError::Ranks(failures) = err else {
        panic!("expected rank failures, got {err}");
    };
    assert_eq!(failures.len(), 2, "{failures:?}");
    for (_, message) in &failures {
        assert!(
            message.contains("rank 1 did not reach collective #1 (all_to_all_single"),
            "{failures:?}"
        );
    }
}

#[test]
fn a_hung_rank_is_left_behind_and_the_run_still_ends() {
    let timeout = Duration::from_millis(300);
    let mut config = common::config(timeout);
    config.fault = Some(Fault {
        rank: 0,
        before_collective: 0,
        kind: FaultKind::Stall(Duration::from_secs(3600)),
    });
    let started = Instant::now();
    let err = run_loopback(common::jobs("moe_ep2", 2), &config).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    let RunError::Ranks(failures) = err else {
        panic!("expected rank failures, got {err}");
    };
    let text: Vec<String> = failures.iter().map(|(r, m)| format!("{r}: {m}")).collect();
    assert!(
        text.iter()
            .any(|t| t.starts_with("0: ") && t.contains("hung")),
        "{text:?}"
    );
    assert!(
        text.iter()
            .any(|t| t.starts_with("1: ") && t.contains("rank 0 did not reach collective #0")),
        "{text:?}"
    );
}

#[test]
fn ranks_holding_different_plans_fail_on_every_rank_naming_both_fingerprints() {
    let mut jobs = common::jobs("moe_ep2", 2);
    let mut other = (*jobs[1].plan).clone();
    other.saved.pop();
    jobs[1].plan = Arc::new(other);
    let plans: Vec<String> = jobs
        .iter()
        .map(|job| runtime::fingerprint::plan(&job.plan, &job.graph))
        .collect();
    let err = run_loopback(jobs, &common::config(Duration::from_secs(20))).unwrap_err();
    let RunError::Ranks(failures) = err else {
        panic!("expected rank failures, got {err}");
    };
    assert_eq!(failures.len(), 2, "{failures:?}");
    assert_ne!(plans[0], plans[1]);
    for (_, message) in &failures {
        assert!(
            message.contains(&plans[0]) && message.contains(&plans[1]),
            "{message} should name {plans:?}"
        );
    }
}
