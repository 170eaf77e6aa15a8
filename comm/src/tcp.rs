//! Ranks as processes over TCP, for CPU ranks launched by torchrun, srun
//! or `strata train --nproc` (no MPI needed): a socket between every pair of
//! ranks, carrying `crate::pairwise`'s transfers. Each message starts with
//! a header (the operation, its number on that link, its bytes), so ranks
//! that call different collectives are told so instead of mixing bytes.
//! Sockets are non-blocking and polled ([`libc::poll`], 10 ms at a time)
//! against the group's [`Cancel`](strata_device::Cancel) and a deadline; a peer whose process is
//! gone closes its sockets, which the others see at once and name
//! ([`CommError::Closed`]). A group cut short refuses every later call
//! ([`CommError::Abandoned`]): its streams are no longer in step.
//!
//! [`TcpWorld::connect`] is the rendezvous. Under torchrun (its agent
//! serves a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT`, said by
//! `TORCHELASTIC_USE_AGENT_STORE`) each rank publishes its listening
//! address under a key of the run and attempt and reads those of the
//! ranks below it (the store's `SET`, `WAIT` and `GET`, as torch's own
//! client sends them). Otherwise rank 0 listens at `MASTER_ADDR:MASTER_PORT`
//! itself and hands every rank the table. Then each rank connects to every
//! rank below it and accepts the ones above.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::pairwise::{Health, Pairwise, Transfer, Transport};

/// The first word of every header and greeting ("STTC").
const MAGIC: u32 = 0x5354_5443;
/// The greeting's protocol version: ranks of other strata versions are
/// refused rather than misread.
const VERSION: u32 = 1;
/// Bytes of a message header: magic, operation, number, length.
const HEADER: usize = 24;
/// Milliseconds one poll waits before the cancel and deadline are looked at.
const POLL_MS: i32 = 10;
/// torch's c10d TCPStore: the magic its clients validate with, and the
/// queries used here (`QueryType` in `TCPStoreBackend.hpp`).
const STORE_MAGIC: u32 = 0x3C85_F7CE;
const STORE_VALIDATE: u8 = 0;
const STORE_SET: u8 = 1;
const STORE_GET: u8 = 3;
const STORE_WAIT: u8 = 6;
/// The store's answer to a `WAIT` whose keys are all set.
const STORE_STOP_WAITING: u8 = 0;
/// The longest value read from the store (an address).
const STORE_VALUE_MAX: u64 = 4096;

/// Where and how the ranks of a job find each other.
#[derive(Clone, Debug)]
pub struct Rendezvous {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// Processes in the job.
    pub world: usize,
    /// `MASTER_ADDR` and `MASTER_PORT`.
    pub master: (String, u16),
    /// Under torchrun's agent store: the prefix of this run's keys there
    /// (unique to the run and its restart). `None`: rank 0 listens at
    /// `master` itself.
    pub store: Option<String>,
    /// How long the rendezvous may take before it names the ranks it has
    /// not heard from.
    pub timeout: Duration,
}

/// This process's sockets to every other rank of the job.
pub struct TcpWorld {
    rank: usize,
    world: usize,
    mesh: Arc<Mesh>,
}

struct Mesh {
    /// The socket to each peer (`None` at this rank's own index).
    links: Mutex<Vec<Option<Link>>>,
    /// An operation was given up: the streams are out of step.
    abandoned: Arc<AtomicBool>,
}

struct Link {
    stream: TcpStream,
    /// Messages sent on it, and received: each header carries its number.
    sent: u64,
    received: u64,
}

/// This process's member of a TCP group ([`TcpWorld::group`]).
pub type Tcp = Pairwise<TcpLinks>;

/// What carries a [`Tcp`] group's transfers: the world's sockets.
pub struct TcpLinks {
    mesh: Arc<Mesh>,
    timeout: Duration,
    health: Health,
}

impl TcpWorld {
    /// Finds every other rank of the job as `rendezvous` says and connects
    /// to each; fails naming the ranks not heard from within its timeout.
    pub fn connect(rendezvous: &Rendezvous) -> Result<TcpWorld> {
        let Rendezvous {
            rank,
            world,
            ref store,
            timeout,
            ..
        } = *rendezvous;
        assert!(rank < world, "rank {rank} of {world}");
        let deadline = Deadline {
            at: Instant::now() + timeout,
            timeout,
        };
        let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        if world > 1 {
            // Rank 0 takes the master port before any port of its own.
            let master = match (store, rank) {
                (None, 0) => Some(listen(rendezvous.master.1)?),
                _ => None,
            };
            let listener = listen(0)?;
            let (table, token) = match store {
                None => by_rank_zero(rendezvous, master, &listener, &deadline)?,
                Some(prefix) => by_store(rendezvous, prefix, &listener, &deadline)?,
            };
            for (peer, stream) in mesh(rank, world, &table, token, &listener, &deadline)?
                .into_iter()
                .enumerate()
            {
                if let Some(stream) = stream {
                    let ready = stream
                        .set_nodelay(true)
                        .and_then(|()| stream.set_nonblocking(true));
                    ready.map_err(|e| setup(format!("set up the socket to rank {peer}: {e}")))?;
                    links[peer] = Some(Link {
                        stream,
                        sent: 0,
                        received: 0,
                    });
                }
            }
        }
        Ok(TcpWorld {
            rank,
            world,
            mesh: Arc::new(Mesh {
                links: Mutex::new(links),
                abandoned: Arc::new(AtomicBool::new(false)),
            }),
        })
    }

    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Processes in the job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// A member of the group of every rank, exchanging at most
    /// `elems_max` elements (of up to 4 bytes) a call, each operation
    /// given up after `timeout`. Groups of one world share its sockets;
    /// use one at a time, in the same order on every rank.
    pub fn group(&self, elems_max: usize, timeout: Duration) -> Tcp {
        let links = TcpLinks {
            mesh: Arc::clone(&self.mesh),
            timeout,
            health: Health::of(&self.mesh.abandoned),
        };
        Pairwise::new(links, self.rank, self.world, elems_max)
    }
}

/// The rendezvous's deadline.
struct Deadline {
    at: Instant,
    timeout: Duration,
}

impl Deadline {
    fn left(&self) -> Option<Duration> {
        let left = self.at.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// The error for ranks not heard from in time.
    fn missed(&self, what: &str, ranks: &[usize]) -> CommError {
        CommError::Rendezvous {
            problem: format!(
                "{what}: no word from rank(s) {ranks:?} within {:.0} s",
                self.timeout.as_secs_f64()
            ),
            fix: "start every rank of the job (WORLD_SIZE of them) with the same MASTER_ADDR and MASTER_PORT; raise [comm] timeout_s if they start slowly".into(),
        }
    }
}

fn setup(problem: String) -> CommError {
    CommError::Rendezvous {
        problem,
        fix: "check that the ranks' machines reach each other over TCP (MASTER_ADDR, firewalls)"
            .into(),
    }
}

/// A port no process listens at now, for rank 0 to listen at: one of
/// 20000-32767, below Linux's ephemeral ports (so no socket another rank
/// opens meanwhile is given it), else any free port.
pub fn free_port() -> Result<u16> {
    use std::hash::{BuildHasher, RandomState};
    let start = RandomState::new().hash_one(std::process::id()) % 12_768;
    for k in 0..64 {
        let port = 20_000 + ((start + k * 197) % 12_768) as u16;
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(listen(0)?
        .local_addr()
        .map_err(|e| setup(format!("a free port: {e}")))?
        .port())
}

/// A listener on every interface at `port` (0: any free port).
fn listen(port: u16) -> Result<TcpListener> {
    TcpListener::bind(("0.0.0.0", port)).map_err(|e| CommError::Rendezvous {
        problem: format!("cannot listen on TCP port {port}: {e}"),
        fix: match port {
            0 => "allow this process to open a TCP socket".into(),
            _ => format!(
                "MASTER_PORT {port} is taken: give a free port (strata train --nproc picks one)"
            ),
        },
    })
}

/// A connection to `addr`, retried until the deadline (the listener may
/// not be up yet).
fn reach(addrs: &[SocketAddr], deadline: &Deadline, what: &str, rank: usize) -> Result<TcpStream> {
    loop {
        let mut last = None;
        for addr in addrs {
            let Some(left) = deadline.left() else { break };
            match TcpStream::connect_timeout(addr, left.min(Duration::from_secs(5))) {
                Ok(stream) => return Ok(stream),
                Err(e) => last = Some(e),
            }
        }
        if deadline.left().is_none() {
            return Err(match last {
                Some(e) if e.kind() != ErrorKind::ConnectionRefused => {
                    setup(format!("{what} at {addrs:?}: {e}"))
                }
                _ => deadline.missed(what, &[rank]),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn resolve(master: &(String, u16)) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = (master.0.as_str(), master.1)
        .to_socket_addrs()
        .map_err(|e| CommError::Rendezvous {
            problem: format!("MASTER_ADDR {} does not resolve: {e}", master.0),
            fix: "set MASTER_ADDR to rank 0's host name or address".into(),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(CommError::Rendezvous {
            problem: format!("MASTER_ADDR {} has no address", master.0),
            fix: "set MASTER_ADDR to rank 0's host name or address".into(),
        });
    }
    Ok(addrs)
}

fn words(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn read_words<const N: usize>(stream: &mut TcpStream) -> std::io::Result<[u64; N]> {
    let mut bytes = [0u8; 8];
    let mut out = [0u64; N];
    for word in &mut out {
        stream.read_exact(&mut bytes)?;
        *word = u64::from_le_bytes(bytes);
    }
    Ok(out)
}

/// A token no other run shares (for rank 0 to hand out).
fn fresh_token() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one((std::process::id(), Instant::now()))
}

/// The greeting each rank sends on a new socket: who it is, of how many,
/// of which run, and the port it listens on.
fn greeting(rank: usize, world: usize, token: u64, port: u16) -> Vec<u8> {
    words(&[
        u64::from(MAGIC) << 32 | u64::from(VERSION),
        rank as u64,
        world as u64,
        token,
        u64::from(port),
    ])
}

/// The longest a new connection may take to greet: a silent one (a
/// probe, a stale process) is dropped, not waited on for the rendezvous.
const GREETING_WAIT: Duration = Duration::from_secs(5);

/// Reads a greeting: (rank, world, token, port), or why it is none.
fn greeted(stream: &mut TcpStream, left: Duration) -> std::result::Result<[u64; 4], String> {
    stream
        .set_read_timeout(Some(left.min(GREETING_WAIT)))
        .map_err(|e| e.to_string())?;
    let [magic, rank, world, token, port] = read_words::<5>(stream).map_err(|e| e.to_string())?;
    if magic != (u64::from(MAGIC) << 32 | u64::from(VERSION)) {
        return Err(format!(
            "a connection that is not a strata rank of this version (magic {magic:#x})"
        ));
    }
    Ok([rank, world, token, port])
}

/// Rank 0 listens at the master port, hears every rank's greeting and
/// answers each with the table of listening addresses and the run's
/// token.
fn by_rank_zero(
    r: &Rendezvous,
    master: Option<TcpListener>,
    listener: &TcpListener,
    deadline: &Deadline,
) -> Result<(Vec<Option<SocketAddr>>, u64)> {
    let port = listener
        .local_addr()
        .map_err(|e| setup(format!("the listener's address: {e}")))?
        .port();
    if r.rank > 0 {
        let addrs = resolve(&r.master)?;
        let mut stream = reach(&addrs, deadline, "reaching rank 0", 0)?;
        let Some(left) = deadline.left() else {
            return Err(deadline.missed("the table from rank 0", &[0]));
        };
        let said = stream
            .write_all(&greeting(r.rank, r.world, 0, port))
            .and_then(|()| stream.set_read_timeout(Some(left)));
        said.map_err(|e| setup(format!("greeting rank 0: {e}")))?;
        let mut table = Vec::with_capacity(r.world);
        let answer = (|| -> std::io::Result<u64> {
            let [token] = read_words::<1>(&mut stream)?;
            for _ in 0..r.world {
                let [len] = read_words::<1>(&mut stream)?;
                let mut text = vec![0u8; len.min(STORE_VALUE_MAX) as usize];
                stream.read_exact(&mut text)?;
                table.push(String::from_utf8_lossy(&text).parse::<SocketAddr>().ok());
            }
            Ok(token)
        })();
        let token = answer.map_err(|_| deadline.missed("the table from rank 0", &[0]))?;
        return Ok((table, token));
    }
    let master = master.expect("rank 0 listens at the master port");
    master
        .set_nonblocking(true)
        .map_err(|e| setup(format!("the master listener: {e}")))?;
    let mut heard: Vec<Option<(TcpStream, SocketAddr)>> = (0..r.world).map(|_| None).collect();
    let mut own = None;
    while heard.iter().skip(1).any(Option::is_none) {
        let Some(left) = deadline.left() else {
            let missing: Vec<usize> = (1..r.world).filter(|&k| heard[k].is_none()).collect();
            return Err(deadline.missed("rank 0 waiting for the ranks' greetings", &missing));
        };
        match master.accept() {
            Ok((mut stream, from)) => {
                // A stray connection is dropped, not a failure of the job.
                let Ok(()) = stream.set_nonblocking(false) else {
                    continue;
                };
                let [rank, world, _, port] = match greeted(&mut stream, left) {
                    Ok(said) => said,
                    Err(why) => {
                        warn(&format!("ignored a connection from {from}: {why}"));
                        continue;
                    }
                };
                if world != r.world as u64 {
                    return Err(CommError::Rendezvous {
                        problem: format!(
                            "rank {rank} says the job has {world} ranks, and rank 0 has {}",
                            r.world
                        ),
                        fix: "launch every rank with the same WORLD_SIZE".into(),
                    });
                }
                let rank = rank as usize;
                if rank == 0 || rank >= r.world || heard[rank].is_some() {
                    return Err(CommError::Rendezvous {
                        problem: format!("two processes say they are rank {rank} of {}", r.world),
                        fix: "give every process its own RANK in 0..WORLD_SIZE".into(),
                    });
                }
                own = own.or_else(|| stream.local_addr().ok());
                let addr = SocketAddr::new(from.ip(), port as u16);
                heard[rank] = Some((stream, addr));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(setup(format!("accepting the ranks' greetings: {e}"))),
        }
    }
    let own = own.expect("a greeting was heard");
    let mut table: Vec<Option<SocketAddr>> = vec![Some(SocketAddr::new(own.ip(), port))];
    table.extend(heard.iter().skip(1).map(|h| h.as_ref().map(|(_, a)| *a)));
    let token = fresh_token();
    let mut answer = words(&[token]);
    for addr in &table {
        let text = addr.expect("every rank heard").to_string();
        answer.extend(words(&[text.len() as u64]));
        answer.extend(text.as_bytes());
    }
    for (rank, slot) in heard.iter_mut().enumerate().skip(1) {
        let (stream, _) = slot.as_mut().expect("every rank heard");
        stream
            .write_all(&answer)
            .map_err(|e| setup(format!("answering rank {rank}: {e}")))?;
    }
    Ok((table, token))
}

/// A warning (this crate has no logger): on stderr.
fn warn(text: &str) {
    eprintln!("strata-comm: {text}");
}

/// torch's c10d TCPStore, as a client: what the rendezvous needs of it.
struct Store {
    stream: TcpStream,
}

impl Store {
    fn open(master: &(String, u16), deadline: &Deadline) -> Result<Store> {
        let addrs = resolve(master)?;
        let mut stream = reach(&addrs, deadline, "reaching torchrun's store", 0)?;
        let mut query = vec![STORE_VALIDATE];
        query.extend(STORE_MAGIC.to_ne_bytes());
        stream
            .write_all(&query)
            .map_err(|e| setup(format!("torchrun's store at {addrs:?}: {e}")))?;
        Ok(Store { stream })
    }

    fn key(query: &mut Vec<u8>, bytes: &[u8]) {
        query.extend((bytes.len() as u64).to_ne_bytes());
        query.extend(bytes);
    }

    fn set(&mut self, key: &str, value: &[u8]) -> std::io::Result<()> {
        let mut query = vec![STORE_SET];
        Store::key(&mut query, key.as_bytes());
        Store::key(&mut query, value);
        self.stream.write_all(&query)
    }

    /// The value of `key`, once some rank has set it (the store answers a
    /// `WAIT` when it is), within `left`.
    fn get(&mut self, key: &str, left: Duration) -> std::io::Result<Vec<u8>> {
        self.stream.set_read_timeout(Some(left))?;
        let mut query = vec![STORE_WAIT];
        query.extend(1u64.to_ne_bytes());
        Store::key(&mut query, key.as_bytes());
        self.stream.write_all(&query)?;
        let mut answer = [0u8; 1];
        self.stream.read_exact(&mut answer)?;
        if answer[0] != STORE_STOP_WAITING {
            return Err(std::io::Error::other(format!(
                "the store answered a wait with {}",
                answer[0]
            )));
        }
        let mut query = vec![STORE_GET];
        Store::key(&mut query, key.as_bytes());
        self.stream.write_all(&query)?;
        let mut len = [0u8; 8];
        self.stream.read_exact(&mut len)?;
        let len = u64::from_ne_bytes(len);
        if len > STORE_VALUE_MAX {
            return Err(std::io::Error::other(format!(
                "a value of {len} bytes, past {STORE_VALUE_MAX}"
            )));
        }
        let mut value = vec![0u8; len as usize];
        self.stream.read_exact(&mut value)?;
        Ok(value)
    }
}

/// Every rank publishes its listening address in torchrun's store and
/// reads those of the ranks below it; the token is the keys' prefix's.
fn by_store(
    r: &Rendezvous,
    prefix: &str,
    listener: &TcpListener,
    deadline: &Deadline,
) -> Result<(Vec<Option<SocketAddr>>, u64)> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut store = Store::open(&r.master, deadline)?;
    let port = listener
        .local_addr()
        .map_err(|e| setup(format!("the listener's address: {e}")))?
        .port();
    // The address this machine reaches the store's from, which the
    // other ranks reach this one at.
    let ip = store
        .stream
        .local_addr()
        .map_err(|e| setup(format!("the store connection's address: {e}")))?
        .ip();
    let key = |rank: usize| format!("{prefix}/strata/addr/{rank}");
    store
        .set(
            &key(r.rank),
            SocketAddr::new(ip, port).to_string().as_bytes(),
        )
        .map_err(|e| {
            setup(format!(
                "publishing this rank's address in torchrun's store: {e}"
            ))
        })?;
    let mut table = vec![None; r.world];
    for (peer, slot) in table.iter_mut().enumerate().take(r.rank) {
        let Some(left) = deadline.left() else {
            return Err(deadline.missed("reading the ranks' addresses", &[peer]));
        };
        let value = store.get(&key(peer), left).map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                deadline.missed("reading the ranks' addresses", &[peer])
            }
            _ => setup(format!(
                "reading rank {peer}'s address from torchrun's store: {e}"
            )),
        })?;
        *slot = Some(
            String::from_utf8_lossy(&value)
                .parse::<SocketAddr>()
                .map_err(|e| setup(format!("rank {peer}'s address in the store: {e}")))?,
        );
    }
    let mut hasher = DefaultHasher::new();
    prefix.hash(&mut hasher);
    Ok((table, hasher.finish()))
}

/// Connects to every rank below `rank` (at its address in `table`) and
/// accepts every rank above, each greeting with the run's `token`.
fn mesh(
    rank: usize,
    world: usize,
    table: &[Option<SocketAddr>],
    token: u64,
    listener: &TcpListener,
    deadline: &Deadline,
) -> Result<Vec<Option<TcpStream>>> {
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    for (peer, addr) in table.iter().enumerate().take(rank) {
        let addr = addr.ok_or_else(|| setup(format!("no address for rank {peer}")))?;
        let mut stream = reach(&[addr], deadline, "connecting to the ranks", peer)?;
        stream
            .write_all(&greeting(rank, world, token, 0))
            .map_err(|e| setup(format!("greeting rank {peer}: {e}")))?;
        streams[peer] = Some(stream);
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| setup(format!("the listener: {e}")))?;
    while streams.iter().skip(rank + 1).any(Option::is_none) {
        let Some(left) = deadline.left() else {
            let missing: Vec<usize> = (rank + 1..world)
                .filter(|&k| streams[k].is_none())
                .collect();
            return Err(deadline.missed("waiting for the ranks' connections", &missing));
        };
        match listener.accept() {
            Ok((mut stream, from)) => {
                let Ok(()) = stream.set_nonblocking(false) else {
                    continue;
                };
                match greeted(&mut stream, left) {
                    Ok([peer, of, said, _])
                        if said == token
                            && of == world as u64
                            && (rank as u64) < peer
                            && peer < world as u64
                            && streams[peer as usize].is_none() =>
                    {
                        streams[peer as usize] = Some(stream);
                    }
                    Ok([peer, of, ..]) => warn(&format!(
                        "ignored a connection from {from}: rank {peer} of {of} of another run or already connected"
                    )),
                    Err(why) => warn(&format!("ignored a connection from {from}: {why}")),
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(setup(format!("accepting the ranks' connections: {e}"))),
        }
    }
    for stream in streams.iter().flatten() {
        stream
            .set_read_timeout(None)
            .map_err(|e| setup(format!("a rank's socket: {e}")))?;
    }
    Ok(streams)
}

/// The number a header gives each operation (a receive matches a send).
/// The header a rank sends its other peers when one of its peers went
/// away (a closed socket), naming that rank: they name it too instead of
/// this rank, whose own sockets close next.
const OP_LOST: u64 = 0xdead;
/// How long a rank that lost a peer goes on sending the messages under
/// way to the others, so that its word of the loss lands between messages.
const LOST_DRAIN: Duration = Duration::from_secs(1);

fn op_code(op: &str) -> u64 {
    match op {
        "all_gather" => 1,
        "reduce_scatter" => 2,
        "all_reduce" => 3,
        "all_reduce_scalars" => 4,
        "broadcast" => 5,
        "send" | "recv" => 6,
        _ => 0,
    }
}

fn op_name(code: u64) -> &'static str {
    match code {
        1 => "all_gather",
        2 => "reduce_scatter",
        3 => "all_reduce",
        4 => "all_reduce_scalars",
        5 => "broadcast",
        6 => "send",
        _ => "an unknown operation",
    }
}

/// One transfer's progress: the header and payload sent so far, and
/// received so far (`*_len` zero: nothing that way).
struct Flow {
    out_head: [u8; HEADER],
    out_at: usize,
    out_len: usize,
    in_head: [u8; HEADER],
    in_at: usize,
    in_len: usize,
    /// The header the peer's message must carry: operation, number, bytes.
    expect: [u64; 3],
    /// The peer's socket refused the rest of this rank's message.
    send_cut: bool,
    /// The peer's socket closed: nothing more comes from it.
    dead: bool,
}

impl Flow {
    fn pending(&self) -> bool {
        !self.dead && ((self.out_at < self.out_len && !self.send_cut) || self.in_at < self.in_len)
    }
}

fn header(code: u64, number: u64, bytes: usize) -> [u8; HEADER] {
    let mut head = [0u8; HEADER];
    head[..8].copy_from_slice(&(u64::from(MAGIC) << 32 | code).to_le_bytes());
    head[8..16].copy_from_slice(&number.to_le_bytes());
    head[16..].copy_from_slice(&(bytes as u64).to_le_bytes());
    head
}

impl TcpLinks {
    /// The error for `error` on the socket to `peer`: a closed peer is
    /// named as gone.
    fn failed(op: &'static str, bytes: usize, peer: usize, error: std::io::Error) -> CommError {
        match error.kind() {
            ErrorKind::ConnectionReset
            | ErrorKind::BrokenPipe
            | ErrorKind::ConnectionAborted
            | ErrorKind::UnexpectedEof => CommError::Closed {
                op,
                bytes: bytes as u64,
                rank: peer,
            },
            _ => CommError::Socket {
                op,
                rank: peer,
                error: error.to_string(),
            },
        }
    }

    /// Receives what the flow's socket holds now, without blocking.
    fn receive_some(
        op: &'static str,
        bytes: usize,
        flow: &mut Flow,
        transfer: &mut Transfer<'_>,
        stream: &mut TcpStream,
    ) -> Result<()> {
        let peer = transfer.peer;
        while flow.in_at < flow.in_len {
            let room = match flow.in_at < HEADER {
                true => &mut flow.in_head[flow.in_at..],
                false => &mut transfer.recv[flow.in_at - HEADER..],
            };
            match stream.read(room) {
                Ok(0) => {
                    return Err(CommError::Closed {
                        op,
                        bytes: bytes as u64,
                        rank: peer,
                    });
                }
                Ok(n) => {
                    flow.in_at += n;
                    if flow.in_at == HEADER {
                        TcpLinks::check(op, bytes, peer, flow)?;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(TcpLinks::failed(op, bytes, peer, e)),
            }
        }
        Ok(())
    }

    /// Sends what the flow's socket takes now, without blocking.
    fn send_some(
        op: &'static str,
        bytes: usize,
        flow: &mut Flow,
        transfer: &Transfer<'_>,
        stream: &mut TcpStream,
    ) -> Result<()> {
        let peer = transfer.peer;
        while flow.out_at < flow.out_len {
            let chunk = match flow.out_at < HEADER {
                true => &flow.out_head[flow.out_at..],
                false => &transfer.send[flow.out_at - HEADER..],
            };
            match stream.write(chunk) {
                Ok(0) => {
                    return Err(CommError::Closed {
                        op,
                        bytes: bytes as u64,
                        rank: peer,
                    });
                }
                Ok(n) => flow.out_at += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(TcpLinks::failed(op, bytes, peer, e)),
            }
        }
        Ok(())
    }

    /// The rank that went away first, where `closed`'s socket closed: a
    /// peer that saw another go says so ([`OP_LOST`]) before its own
    /// sockets close, and its word may wait unread at a message boundary.
    fn origin(
        closed: usize,
        links: &[Option<Link>],
        flows: &[Flow],
        transfers: &[Transfer<'_>],
    ) -> usize {
        let mut head = [0u8; HEADER];
        for (peer, link) in links.iter().enumerate() {
            let Some(link) = link else { continue };
            let mid_message = flows
                .iter()
                .zip(transfers)
                .any(|(f, t)| t.peer == peer && f.in_at > 0 && f.in_at < f.in_len);
            if mid_message || link.stream.peek(&mut head).ok() != Some(HEADER) {
                continue;
            }
            let word = |i: usize| {
                u64::from_le_bytes(head[i * 8..(i + 1) * 8].try_into().expect("8 bytes"))
            };
            if word(0) == (u64::from(MAGIC) << 32 | OP_LOST) {
                return word(1) as usize;
            }
        }
        closed
    }

    /// Tells every peer but `gone` that `gone` went away ([`OP_LOST`]),
    /// so that they name it rather than this rank, whose sockets close
    /// next. A message under way to a peer is finished first (for up to
    /// [`LOST_DRAIN`]), so the word lands between messages; a peer it
    /// cannot reach so only sees this rank's socket close.
    fn tell_lost(
        op: &'static str,
        bytes: usize,
        gone: usize,
        links: &mut [Option<Link>],
        flows: &mut [Flow],
        transfers: &[Transfer<'_>],
    ) {
        let until = Instant::now() + LOST_DRAIN;
        let mut cut: Vec<usize> = Vec::new();
        loop {
            let mut under_way = false;
            for (flow, transfer) in flows.iter_mut().zip(transfers) {
                let peer = transfer.peer;
                if peer == gone || cut.contains(&peer) || flow.send_cut || flow.out_at == 0 {
                    continue;
                }
                let link = links[peer].as_mut().expect("a socket to every peer");
                match TcpLinks::send_some(op, bytes, flow, transfer, &mut link.stream) {
                    Ok(()) => under_way |= flow.out_at < flow.out_len,
                    Err(_) => cut.push(peer),
                }
            }
            if !under_way || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        for (flow, transfer) in flows.iter().zip(transfers) {
            if flow.send_cut || (flow.out_at > 0 && flow.out_at < flow.out_len) {
                cut.push(transfer.peer);
            }
        }
        for (peer, link) in links.iter_mut().enumerate() {
            let Some(link) = link.as_mut().filter(|_| peer != gone) else {
                continue;
            };
            if !cut.contains(&peer) {
                let _ = link.stream.write(&header(OP_LOST, gone as u64, 0));
            }
            let _ = link.stream.shutdown(std::net::Shutdown::Write);
        }
    }

    /// `Disagree` unless the header received is the one expected (or
    /// `Closed` naming the rank a peer lost).
    fn check(op: &'static str, bytes: usize, peer: usize, flow: &Flow) -> Result<()> {
        let word = |i: usize| {
            u64::from_le_bytes(
                flow.in_head[i * 8..(i + 1) * 8]
                    .try_into()
                    .expect("8 bytes"),
            )
        };
        let (first, number, len) = (word(0), word(1), word(2));
        if first == (u64::from(MAGIC) << 32 | OP_LOST) {
            return Err(CommError::Closed {
                op,
                bytes: bytes as u64,
                rank: number as usize,
            });
        }
        let [code, want_number, want_len] = flow.expect;
        if first == (u64::from(MAGIC) << 32 | code) && number == want_number && len == want_len {
            return Ok(());
        }
        let expected = format!("{op} #{want_number} of {want_len} bytes");
        let got = match first >> 32 == u64::from(MAGIC) {
            true => format!("{} #{number} of {len} bytes", op_name(first & 0xffff_ffff)),
            false => "bytes that are no strata header".into(),
        };
        Err(CommError::Disagree {
            rank: peer,
            expected,
            got,
        })
    }
}

impl Transport for TcpLinks {
    fn health(&self) -> &Health {
        &self.health
    }

    fn sibling(&self) -> TcpLinks {
        TcpLinks {
            mesh: Arc::clone(&self.mesh),
            timeout: self.timeout,
            health: self.health.sibling(),
        }
    }

    fn exchange(
        &self,
        op: &'static str,
        bytes: usize,
        transfers: &mut [Transfer<'_>],
    ) -> Result<()> {
        let mut links = self.mesh.links.lock().expect("links");
        let code = op_code(op);
        let mut flows: Vec<Flow> = Vec::with_capacity(transfers.len());
        for transfer in transfers.iter() {
            let link = links[transfer.peer]
                .as_mut()
                .expect("a socket to every peer");
            let (send, recv) = (transfer.send.len(), transfer.recv.len());
            let mut flow = Flow {
                out_head: header(code, link.sent, send),
                out_at: 0,
                out_len: if send > 0 { HEADER + send } else { 0 },
                in_head: [0; HEADER],
                in_at: 0,
                in_len: if recv > 0 { HEADER + recv } else { 0 },
                expect: [code, link.received, recv as u64],
                send_cut: false,
                dead: false,
            };
            link.sent += u64::from(send > 0);
            link.received += u64::from(recv > 0);
            if send == 0 {
                flow.out_head = [0; HEADER];
            }
            flows.push(flow);
        }
        let started = Instant::now();
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(flows.len());
        // The first peer whose socket closed, and a rank a peer said went
        // away: once one closed, the messages between the others are
        // finished (for up to LOST_DRAIN), so that word of the first to go
        // can arrive and be passed on.
        let (mut closed, mut lost, mut drain_until) = (None, None, None);
        let outcome = loop {
            let mut failed = None;
            for (flow, transfer) in flows.iter_mut().zip(transfers.iter_mut()) {
                if flow.dead {
                    continue;
                }
                let peer = transfer.peer;
                let stream = &mut links[peer].as_mut().expect("a socket to every peer").stream;
                if !flow.send_cut {
                    match TcpLinks::send_some(op, bytes, flow, transfer, stream) {
                        Ok(()) => {}
                        Err(CommError::Closed { .. }) => {
                            flow.send_cut = true;
                            closed.get_or_insert(peer);
                        }
                        Err(e) => failed = failed.or(Some(e)),
                    }
                }
                match TcpLinks::receive_some(op, bytes, flow, transfer, stream) {
                    Ok(()) => {}
                    Err(CommError::Closed { rank, .. }) => {
                        flow.dead = true;
                        match rank == peer {
                            true => closed.get_or_insert(peer),
                            false => lost.get_or_insert(rank),
                        };
                    }
                    Err(e) => failed = failed.or(Some(e)),
                }
            }
            if let Some(e) = failed {
                break Err(e);
            }
            let pending = flows.iter().any(Flow::pending);
            if let Some(rank) = lost.or(closed) {
                let until = *drain_until.get_or_insert_with(|| Instant::now() + LOST_DRAIN);
                if lost.is_some() || !pending || Instant::now() >= until {
                    break Err(CommError::Closed {
                        op,
                        bytes: bytes as u64,
                        rank,
                    });
                }
            } else if !pending {
                break Ok(());
            }
            let waited = started.elapsed();
            if self.health.cancel.is_cancelled() {
                break Err(CommError::Cancelled);
            }
            if waited >= self.timeout {
                let peers = flows
                    .iter()
                    .zip(transfers.iter())
                    .filter(|(flow, _)| flow.pending())
                    .map(|(_, t)| t.peer)
                    .collect();
                break Err(CommError::Timeout {
                    op,
                    bytes: bytes as u64,
                    peers,
                    waited_s: waited.as_secs_f64(),
                });
            }
            fds.clear();
            for (flow, transfer) in flows.iter().zip(transfers.iter()) {
                if !flow.pending() {
                    continue;
                }
                let stream = &links[transfer.peer].as_ref().expect("a socket").stream;
                let mut events = 0;
                if flow.out_at < flow.out_len && !flow.send_cut {
                    events |= libc::POLLOUT;
                }
                if flow.in_at < flow.in_len {
                    events |= libc::POLLIN;
                }
                fds.push(libc::pollfd {
                    fd: stream.as_raw_fd(),
                    events,
                    revents: 0,
                });
            }
            // An interrupted or failed poll only ends this wait early; the
            // loop looks at every socket again.
            // SAFETY: `fds` is a live, writable array of `fds.len()`
            // pollfds over sockets this group owns (the lock is held).
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, POLL_MS) };
        };
        let outcome = match outcome {
            Err(CommError::Closed { op, bytes, rank }) => {
                let gone = TcpLinks::origin(rank, &links, &flows, transfers);
                TcpLinks::tell_lost(op, bytes as usize, gone, &mut links, &mut flows, transfers);
                Err(CommError::Closed {
                    op,
                    bytes,
                    rank: gone,
                })
            }
            other => other,
        };
        if outcome.is_err() {
            // The streams are out of step: the group cannot go on.
            self.health.abandon();
        }
        outcome
    }
}
