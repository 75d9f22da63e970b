//! The TCP rendezvous and control channel of NCCL ranks, with ranks as threads on localhost:
//! agreement before anything runs, and one abort naming the rank at fault for every rank.

use std::{net::SocketAddr, thread, time::Duration};

use runtime::comm::{
    rendezvous::{Coordinator, Hub},
    CommError, Identity,
};

const TIMEOUT: Duration = Duration::from_secs(10);

fn identity(plan: &str) -> Identity {
    Identity {
        structure: "s0".to_owned(),
        plan: plan.to_owned(),
    }
}

fn hub(world: usize, timeout: Duration) -> SocketAddr {
    Hub::start(("127.0.0.1", 0), world, vec![7, 0, 255], timeout)
        .expect("the hub starts")
        .address
}

/// Every rank joins with its plan fingerprint; each rank's join result.
fn join_all(plans: &[&str]) -> Vec<Result<(Coordinator, Vec<u8>), CommError>> {
    let world = plans.len();
    let address = hub(world, TIMEOUT);
    let handles: Vec<_> = plans
        .iter()
        .enumerate()
        .map(|(rank, plan)| {
            let id = identity(plan);
            thread::spawn(move || Coordinator::join(address, rank, world, &id, TIMEOUT))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("joins"))
        .collect()
}

fn joined(plans: &[&str]) -> Vec<Coordinator> {
    join_all(plans)
        .into_iter()
        .map(|r| r.expect("the rank joins").0)
        .collect()
}

#[test]
fn ranks_that_agree_all_receive_the_hub_s_id() {
    for result in join_all(&["p", "p", "p"]) {
        let (_, id) = result.expect("joined");
        assert_eq!(id, vec![7, 0, 255]);
    }
}

#[test]
fn a_rank_with_another_plan_is_refused_on_every_rank_naming_both_fingerprints() {
    for (rank, result) in join_all(&["aaaa", "aaaa", "bbbb"]).into_iter().enumerate() {
        let err = result.err().expect("refused");
        let text = err.to_string();
        assert!(matches!(err, CommError::Mismatch { .. }), "{text}");
        assert!(
            text.contains("plan aaaa") && text.contains("plan bbbb"),
            "rank {rank}: {text}"
        );
    }
}

#[test]
fn a_rank_that_never_reaches_a_collective_is_named_in_every_rank_s_abort() {
    let ranks = joined(&["p", "p", "p"]);
    for r in &ranks {
        r.arrive(0);
    }
    ranks[0].arrive(1);
    ranks[1].arrive(1);
    let site = "collective #1 (all_to_all_single at node `a2a`)";
    // A real timeout comes long after the arrivals reached the hub.
    thread::sleep(Duration::from_millis(200));
    ranks[0].timed_out(1, site);
    for r in &ranks {
        let err = r.wait_aborted(TIMEOUT).expect("aborted");
        assert_eq!(
            err,
            CommError::Stalled {
                rank: 2,
                site: site.to_owned(),
                seconds: TIMEOUT.as_secs_f64(),
            }
        );
    }
}

#[test]
fn a_failing_rank_aborts_every_rank_naming_it() {
    let ranks = joined(&["p", "p", "p"]);
    ranks[1].abort("out of memory at node mm_3");
    for r in &ranks {
        let err = r.wait_aborted(TIMEOUT).expect("aborted");
        assert_eq!(
            err,
            CommError::RankFailed {
                rank: 1,
                message: "out of memory at node mm_3".to_owned(),
            }
        );
    }
}

#[test]
fn a_rank_that_disappears_before_finishing_aborts_the_others() {
    let mut ranks = joined(&["p", "p"]);
    drop(ranks.pop());
    let err = ranks[0].wait_aborted(TIMEOUT).expect("aborted");
    assert!(
        err.to_string().contains("rank 1 exited before finishing"),
        "{err}"
    );
}

#[test]
fn a_rank_that_finishes_and_exits_does_not_abort_the_others() {
    let mut ranks = joined(&["p", "p"]);
    let finished = ranks.pop().expect("rank 1");
    finished.done();
    drop(finished);
    assert_eq!(ranks[0].wait_aborted(Duration::from_millis(300)), None);
}

#[test]
fn a_rank_missing_at_the_rendezvous_is_named_within_the_timeout() {
    let timeout = Duration::from_millis(300);
    let address = hub(2, timeout);
    let err = Coordinator::join(address, 0, 2, &identity("p"), timeout)
        .err()
        .expect("the rendezvous fails");
    let text = err.to_string();
    assert!(
        text.contains("rank 1 did not reach the rendezvous"),
        "{text}"
    );
}
