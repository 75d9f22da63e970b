//! Ranks in separate processes, launched as PyTorch launches them (`torchrun`, or any launcher
//! that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`), meet as
//! PyTorch's `env://` rendezvous does: through a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT`.
//! Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) that store is the agent's and every
//! rank is a client, with keys under `/worker/attempt_<restart count>`; otherwise rank 0
//! serves it, on all interfaces, as PyTorch's rank 0 does.
//!
//! Rank 0 then starts the control channel's hub ([`Hub`]) on a free port of all interfaces and
//! publishes its address in the store; every rank reads it from there. The hub checks that
//! the ranks run the same graph and plan, hands out the communicator's id (NCCL's unique id;
//! nothing for gloo) and relays aborts naming the rank at fault.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket},
    time::Duration,
};

use super::{
    c10d::{Store, StoreAddress},
    rendezvous::Hub,
    CommError,
};

/// The store key under which rank 0 publishes the hub's address.
const HUB_KEY: &str = "planner/hub";

/// This process's place in a job launched like PyTorch's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub world: usize,
    /// The rank's index on its host (its GPU, on CUDA).
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The launcher hosts the store (torchrun's agent): every rank is a client.
    pub agent_store: bool,
    /// How many times the launcher restarted the job (torchrun's keys are per attempt).
    pub attempt: u64,
}

impl Launch {
    /// This process's launch, from its environment; `None` unless `RANK` and `WORLD_SIZE` are
    /// set.
    pub fn from_env() -> Result<Option<Launch>, String> {
        Launch::from_vars(|name| std::env::var(name).ok())
    }

    /// The launch the variables `var` answers describe.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>, String> {
        let (Some(rank), Some(world)) = (var("RANK"), var("WORLD_SIZE")) else {
            return Ok(None);
        };
        let number = |name: &str, text: Option<String>| -> Result<u64, String> {
            let text = text.ok_or_else(|| format!("{name} is not set"))?;
            text.trim()
                .parse()
                .map_err(|_| format!("{name}=`{text}` is not a number"))
        };
        let index = |name: &str, text: Option<String>| -> Result<usize, String> {
            usize::try_from(number(name, text)?).map_err(|_| format!("{name} is too large"))
        };
        let rank = index("RANK", Some(rank))?;
        let world = index("WORLD_SIZE", Some(world))?;
        if world == 0 || rank >= world {
            return Err(format!(
                "RANK={rank} is not a rank of WORLD_SIZE={world} (0 <= RANK < WORLD_SIZE)"
            ));
        }
        let port = var("MASTER_PORT");
        let master_port = u16::try_from(number("MASTER_PORT", port.clone())?)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| {
                format!(
                    "MASTER_PORT=`{}` is not a TCP port (1 to 65535)",
                    port.unwrap_or_default()
                )
            })?;
        let master_addr = var("MASTER_ADDR")
            .filter(|a| !a.trim().is_empty())
            .ok_or("MASTER_ADDR is not set")?;
        Ok(Some(Launch {
            rank,
            world,
            local_rank: var("LOCAL_RANK").map_or(Ok(0), |l| index("LOCAL_RANK", Some(l)))?,
            master_addr: master_addr.trim().to_owned(),
            master_port,
            agent_store: var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True"),
            attempt: var("TORCHELASTIC_RESTART_COUNT")
                .map_or(Ok(0), |a| number("TORCHELASTIC_RESTART_COUNT", Some(a)))?,
        }))
    }

    /// Whether this process serves the store (rank 0 without a launcher's store).
    fn serves_store(&self) -> bool {
        !self.agent_store && self.rank == 0
    }

    /// The launcher's store, or the one rank 0 serves.
    pub fn store(&self, timeout: Duration) -> Result<Store, CommError> {
        let prefix = if self.agent_store {
            format!("/worker/attempt_{}", self.attempt)
        } else {
            String::new()
        };
        let address = StoreAddress {
            host: &self.master_addr,
            port: self.master_port,
            server: self.serves_store(),
            workers: self.world,
            prefix: &prefix,
        };
        Store::open(&address, timeout).map_err(|e| {
            CommError::Transport(format!(
                "the store at {}:{} (MASTER_ADDR:MASTER_PORT) did not form within {} s: {e}",
                self.master_addr,
                self.master_port,
                timeout.as_secs_f64()
            ))
        })
    }

    /// The address of the master as this host routes to it.
    fn master(&self) -> Result<SocketAddr, CommError> {
        (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| CommError::Transport(format!("MASTER_ADDR `{}`: {e}", self.master_addr)))?
            .next()
            .ok_or_else(|| {
                CommError::Transport(format!(
                    "MASTER_ADDR `{}` resolves to no address",
                    self.master_addr
                ))
            })
    }
}

/// Where rank 0's hub can be reached from the other ranks: the address of this host's
/// interface that routes to the master (a UDP socket connected there sends nothing).
fn reachable_ip(master: SocketAddr) -> Result<IpAddr, CommError> {
    let any: SocketAddr = match master {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let route = |e: std::io::Error| {
        CommError::Transport(format!(
            "no route from this host to the master {master}: {e}"
        ))
    };
    let socket = UdpSocket::bind(any).map_err(route)?;
    socket.connect(master).map_err(route)?;
    Ok(socket.local_addr().map_err(route)?.ip())
}

/// Rank 0: starts the hub on a free port of all interfaces and publishes where it is;
/// `id` is what the hub hands every rank once they agree.
pub fn host_hub(
    launch: &Launch,
    store: &Store,
    id: Vec<u8>,
    timeout: Duration,
) -> Result<Hub, CommError> {
    let ip = reachable_ip(launch.master()?)?;
    let all: IpAddr = match ip {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let hub = Hub::start((all, 0), launch.world, id, timeout)?;
    let published = SocketAddr::new(ip, hub.address.port());
    store
        .set(HUB_KEY, &published.to_string())
        .map_err(|e| CommError::Transport(format!("cannot publish the hub's address: {e}")))?;
    Ok(hub)
}

/// Every rank: the hub's address, as rank 0 published it (within the store's timeout).
pub fn find_hub(store: &Store, timeout: Duration) -> Result<SocketAddr, CommError> {
    let text = store.get(HUB_KEY).map_err(|e| CommError::Stalled {
        rank: 0,
        site: format!("the rendezvous (it publishes its hub's address in the store: {e})"),
        seconds: timeout.as_secs_f64(),
    })?;
    text.parse().map_err(|_| {
        CommError::Transport(format!("rank 0 published a malformed hub address `{text}`"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<Launch>, String> {
        Launch::from_vars(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    const TORCHRUN: [(&str, &str); 7] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", "0"),
    ];

    #[test]
    fn torchruns_environment_is_a_launch_on_the_agents_store() {
        let got = launch(&TORCHRUN).unwrap().unwrap();
        assert_eq!(
            got,
            Launch {
                rank: 1,
                world: 2,
                local_rank: 1,
                master_addr: "127.0.0.1".to_owned(),
                master_port: 29500,
                agent_store: true,
                attempt: 0,
            }
        );
        assert!(!got.serves_store());
    }

    #[test]
    fn without_rank_and_world_size_there_is_no_launch() {
        assert_eq!(launch(&[("MASTER_PORT", "1")]), Ok(None));
    }

    #[test]
    fn rank_0_serves_the_store_without_a_launchers_store() {
        let vars = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
        ];
        assert!(launch(&vars).unwrap().unwrap().serves_store());
    }

    fn error_with(name: &str, value: Option<&str>) -> String {
        let vars: Vec<(&str, &str)> = TORCHRUN
            .iter()
            .copied()
            .filter(|(k, _)| *k != name)
            .chain(value.map(|v| (name, v)))
            .collect();
        launch(&vars).unwrap_err()
    }

    #[test]
    fn a_missing_or_malformed_master_port_is_an_error_naming_it() {
        assert_eq!(error_with("MASTER_PORT", None), "MASTER_PORT is not set");
        assert!(error_with("MASTER_PORT", Some("http")).contains("MASTER_PORT=`http`"));
        // A port above 65535 is refused, not wrapped.
        assert!(error_with("MASTER_PORT", Some("65536")).contains("not a TCP port"));
        assert!(error_with("MASTER_PORT", Some("0")).contains("not a TCP port"));
    }

    #[test]
    fn a_rank_outside_the_world_is_an_error() {
        assert!(error_with("RANK", Some("2")).contains("RANK=2 is not a rank of WORLD_SIZE=2"));
        assert!(error_with("MASTER_ADDR", None).contains("MASTER_ADDR is not set"));
    }
}
