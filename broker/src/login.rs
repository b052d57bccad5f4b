//! Password checks: argon2 on a small fixed pool of threads, each with its own reusable memory,
//! fed by bounded lanes, and back-off for addresses and usernames that keep failing. argon2 is
//! slow and large on purpose; this is what keeps wrong passwords from costing the node more
//! than `threads × m_cost` of memory and `threads` cores (docs/security.md, "Password checks").

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use argon2::password_hash::{Output, PasswordHash};
use argon2::{Algorithm, Argon2, Block, Params, Version};
use serde::Deserialize;
use tokio::sync::oneshot;

/// How password checks are run and how failing clients are held off (`broker.auth.checks`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CheckConfig {
    /// Threads that run argon2; each keeps one hash's memory (`m_cost` KiB) for reuse.
    #[serde(default = "default_threads")]
    pub threads: usize,
    /// Checks that may wait for a thread in each lane; past it a login is refused at once as
    /// "server busy" (MQTT 5 0x89, 3.1.1 return code 3).
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// Largest argon2 memory cost (KiB) a configured hash may ask for: the bound on a check's
    /// memory.
    #[serde(default = "default_max_hash_kib")]
    pub max_hash_kib: u32,
    /// Failures an address or a username may have before it is held off.
    #[serde(default = "default_free_failures")]
    pub free_failures: u32,
    /// The longest a failing address or username is held off, in seconds (the wait doubles
    /// from one second with each failure past `free_failures`).
    #[serde(default = "default_backoff_max_s")]
    pub backoff_max_s: u64,
    /// Addresses and usernames remembered for back-off at most; the stalest go first.
    #[serde(default = "default_remembered")]
    pub remembered: usize,
}

const fn default_threads() -> usize {
    1
}
const fn default_queue() -> usize {
    16
}
const fn default_max_hash_kib() -> u32 {
    64 * 1024
}
const fn default_free_failures() -> u32 {
    3
}
const fn default_backoff_max_s() -> u64 {
    60
}
const fn default_remembered() -> usize {
    10_000
}

impl Default for CheckConfig {
    fn default() -> Self {
        CheckConfig {
            threads: default_threads(),
            queue: default_queue(),
            max_hash_kib: default_max_hash_kib(),
            free_failures: default_free_failures(),
            backoff_max_s: default_backoff_max_s(),
            remembered: default_remembered(),
        }
    }
}

impl CheckConfig {
    /// Checks what serde cannot; errors name the offending key.
    pub fn validate(&self) -> Result<(), String> {
        if self.threads == 0 || self.threads > 64 {
            return Err("broker.auth.checks.threads must be between 1 and 64".into());
        }
        if self.queue == 0 || self.remembered == 0 {
            return Err("broker.auth.checks.queue and .remembered must be at least 1".into());
        }
        Ok(())
    }
}

/// A login check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Admitted,
    Refused,
    /// Not checked: the queue is full or the address or username is held off.
    Busy,
}

/// The argon2 memory cost (KiB) a stored PHC hash asks for.
pub fn memory_kib(phc: &str) -> Result<u32, String> {
    let hash = PasswordHash::new(phc).map_err(|e| e.to_string())?;
    Params::try_from(&hash)
        .map(|p| p.m_cost())
        .map_err(|e| e.to_string())
}

/// One check waiting for a thread.
struct Job {
    phc: Arc<str>,
    password: String,
    answer: oneshot::Sender<bool>,
}

/// The lanes the pool's threads take from: clients that logged in before (the same address,
/// username and client id) first, so a storm of strangers cannot delay them.
#[derive(Default)]
struct Lanes {
    known: VecDeque<Job>,
    other: VecDeque<Job>,
    closed: bool,
}

struct Pool {
    lanes: Mutex<Lanes>,
    ready: Condvar,
}

/// Failures remembered for one address or username.
#[derive(Clone, Copy)]
struct Strike {
    failures: u32,
    /// Refused unchecked until then.
    until: Instant,
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum Key {
    Address(IpAddr),
    User(Arc<str>),
}

/// A client that logged in: its address, username and client id.
type Known = (IpAddr, Arc<str>, Arc<str>);

/// Who failed lately, who succeeded, and the checks in flight per address.
#[derive(Default)]
struct Memory {
    strikes: HashMap<Key, Strike>,
    known: HashSet<Known>,
    known_order: VecDeque<Known>,
    pending: HashMap<IpAddr, usize>,
}

/// The password checker: a pool started at the first check, and its back-off memory.
pub struct Checker {
    config: CheckConfig,
    pool: std::sync::OnceLock<Arc<Pool>>,
    memory: Mutex<Memory>,
}

impl std::fmt::Debug for Checker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checker")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A check counted against its address (when it is), until dropped however the login ends:
/// a client that leaves mid-check must not hold its address's places.
struct Pending<'a> {
    checker: &'a Checker,
    address: Option<IpAddr>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let Some(address) = self.address else {
            return;
        };
        let mut memory = self
            .checker
            .memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(waiting) = memory.pending.get_mut(&address) {
            *waiting -= 1;
            if *waiting == 0 {
                memory.pending.remove(&address);
            }
        }
    }
}

/// Who asks for a check.
pub struct Who<'a> {
    pub peer: Option<IpAddr>,
    pub user: &'a str,
    pub client_id: &'a str,
}

/// Checks one address may have waiting or running at once (a client that logged in before
/// from it is not counted).
const PENDING_PER_ADDRESS: usize = 2;

impl Checker {
    pub fn new(config: CheckConfig) -> Checker {
        Checker {
            config,
            pool: std::sync::OnceLock::new(),
            memory: Mutex::new(Memory::default()),
        }
    }

    /// Checks `password` against the stored hash `phc` for `user` connecting from `peer` as
    /// `client_id`. A client that logged in before as the same address, username and client
    /// id is never held off and goes first; anyone else is held off while its address or the
    /// username is (a client id alone is no credential: anyone may send any).
    pub async fn check(&self, who: Who<'_>, phc: Arc<str>, password: String) -> Verdict {
        let address = who.peer.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let user: Arc<str> = Arc::from(who.user);
        let client: Known = (address, user.clone(), Arc::from(who.client_id));
        let now = Instant::now();
        let (known, _pending) = {
            let mut memory = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
            let known = memory.known.contains(&client);
            let mut pending = Pending {
                checker: self,
                address: None,
            };
            if !known {
                let held_off = [Key::Address(address), Key::User(user.clone())]
                    .iter()
                    .any(|k| memory.strikes.get(k).is_some_and(|s| s.until > now));
                let waiting = memory.pending.get(&address).copied().unwrap_or(0);
                if held_off || waiting >= PENDING_PER_ADDRESS {
                    return Verdict::Busy;
                }
                memory.pending.insert(address, waiting + 1);
                pending.address = Some(address);
            }
            (known, pending)
        };
        let (answer, answered) = oneshot::channel();
        let job = Job {
            phc,
            password,
            answer,
        };
        let ok = if self.enqueue(job, known) {
            answered.await.unwrap_or(false)
        } else {
            return Verdict::Busy;
        };
        self.settle(&client, ok);
        if ok {
            Verdict::Admitted
        } else {
            Verdict::Refused
        }
    }

    /// Puts a check in its lane; false when the lane is full.
    fn enqueue(&self, job: Job, known: bool) -> bool {
        let pool = self.pool.get_or_init(|| self.start());
        let mut lanes = pool.lanes.lock().unwrap_or_else(PoisonError::into_inner);
        let lane = if known {
            &mut lanes.known
        } else {
            &mut lanes.other
        };
        if lane.len() >= self.config.queue {
            return false;
        }
        lane.push_back(job);
        drop(lanes);
        pool.ready.notify_one();
        true
    }

    /// Records a check's outcome.
    fn settle(&self, client: &Known, ok: bool) {
        let (address, user, _) = client;
        let address = *address;
        let mut memory = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
        if !ok {
            // A known client that fails is no longer known: it queues and is held off as any.
            memory.known.remove(client);
            for key in [Key::Address(address), Key::User(user.clone())] {
                self.strike(&mut memory, key);
            }
            return;
        }
        memory.strikes.remove(&Key::User(user.clone()));
        if memory.known.insert(client.clone()) {
            memory.known_order.push_back(client.clone());
            if memory.known_order.len() > self.config.remembered {
                if let Some(old) = memory.known_order.pop_front() {
                    memory.known.remove(&old);
                }
            }
        }
    }

    /// One more failure for `key`: past the free ones, held off for a doubling while.
    fn strike(&self, memory: &mut Memory, key: Key) {
        let now = Instant::now();
        if memory.strikes.len() >= self.config.remembered && !memory.strikes.contains_key(&key) {
            // Forget the failures whose hold ended, else the one whose hold ends first.
            memory.strikes.retain(|_, s| s.until > now);
            if memory.strikes.len() >= self.config.remembered {
                let stalest = memory
                    .strikes
                    .iter()
                    .min_by_key(|(_, s)| s.until)
                    .map(|(k, _)| k.clone());
                if let Some(stalest) = stalest {
                    memory.strikes.remove(&stalest);
                }
            }
        }
        let strike = memory.strikes.entry(key).or_insert(Strike {
            failures: 0,
            until: now,
        });
        strike.failures = strike.failures.saturating_add(1);
        if let Some(past) = strike.failures.checked_sub(self.config.free_failures + 1) {
            let wait = Duration::from_secs(1u64 << past.min(16))
                .min(Duration::from_secs(self.config.backoff_max_s));
            strike.until = now + wait;
        }
    }

    /// Starts the pool's threads; each ends when the checker is dropped.
    fn start(&self) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            lanes: Mutex::new(Lanes::default()),
            ready: Condvar::new(),
        });
        for n in 0..self.config.threads {
            let pool = pool.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("edgemeta-login-{n}"))
                .spawn(move || work(&pool));
            if let Err(e) = spawned {
                tracing::error!(error_code = "EM-AUTH-POOL", error = %e, "cannot start a password check thread");
            }
        }
        pool
    }
}

impl Drop for Checker {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.get() {
            pool.lanes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .closed = true;
            pool.ready.notify_all();
        }
    }
}

/// One pool thread: takes checks, known clients first, until the checker is dropped.
fn work(pool: &Pool) {
    let mut memory: Vec<Block> = Vec::new();
    loop {
        let job = {
            let mut lanes = pool.lanes.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                if lanes.closed {
                    return;
                }
                if let Some(job) = lanes.known.pop_front().or_else(|| lanes.other.pop_front()) {
                    break job;
                }
                lanes = pool
                    .ready
                    .wait(lanes)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        };
        let ok = verify(&job.phc, job.password.as_bytes(), &mut memory);
        let _ = job.answer.send(ok);
    }
}

/// Whether `password` hashes to the PHC string `phc`, in this thread's reused `memory`
/// (grown once to the hash's `m_cost` blocks of 1 KiB).
pub fn verify(phc: &str, password: &[u8], memory: &mut Vec<Block>) -> bool {
    let Ok(hash) = PasswordHash::new(phc) else {
        return false;
    };
    let (Ok(algorithm), Ok(params)) =
        (Algorithm::try_from(hash.algorithm), Params::try_from(&hash))
    else {
        return false;
    };
    let version = match hash.version.map(Version::try_from) {
        None => Version::default(),
        Some(Ok(version)) => version,
        Some(Err(_)) => return false,
    };
    let (Some(salt), Some(expected)) = (hash.salt, hash.hash) else {
        return false;
    };
    let mut salt_bytes = [0u8; 64];
    let Ok(salt) = salt.decode_b64(&mut salt_bytes) else {
        return false;
    };
    let blocks = params.block_count();
    if memory.len() < blocks {
        memory.resize(blocks, Block::default());
    }
    let argon2 = Argon2::new(algorithm, version, params);
    let computed = Output::init_with(expected.len(), |out| {
        argon2
            .hash_password_into_with_memory(password, salt, out, &mut memory[..blocks])
            .map_err(|_| argon2::password_hash::Error::Password)
    });
    // Output's equality is constant-time.
    computed.is_ok_and(|computed| computed == expected)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::security::hash_password;

    #[test]
    fn verifies_in_reused_memory_as_argon2_does() {
        let phc = hash_password("hunter2").unwrap();
        let mut memory = Vec::new();
        assert!(verify(&phc, b"hunter2", &mut memory));
        let kept = memory.len();
        assert_eq!(kept as u32, memory_kib(&phc).unwrap());
        assert!(!verify(&phc, b"hunter3", &mut memory));
        assert_eq!(memory.len(), kept, "the memory is reused, not grown");
    }

    fn checker(queue: usize) -> Checker {
        Checker::new(CheckConfig {
            queue,
            ..CheckConfig::default()
        })
    }

    #[tokio::test]
    async fn a_login_abandoned_mid_check_gives_its_address_its_place_back() {
        let phc: Arc<str> = hash_password("right").unwrap().into();
        let checker = checker(16);
        let here = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let who = |client_id| Who {
            peer: here,
            user: "alice",
            client_id,
        };
        for _ in 0..3 {
            let abandoned = checker.check(who("gone"), phc.clone(), "wrong".into());
            let _ = tokio::time::timeout(Duration::from_micros(100), abandoned).await;
        }
        let v = checker.check(who("new"), phc, "right".into()).await;
        assert_eq!(v, Verdict::Admitted);
    }

    #[tokio::test]
    async fn an_address_that_keeps_failing_is_held_off_but_a_known_client_from_it_is_not() {
        let phc: Arc<str> = hash_password("right").unwrap().into();
        let checker = checker(16);
        let here = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let elsewhere = Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)));
        let who = |peer, user, client_id| Who {
            peer,
            user,
            client_id,
        };
        let check =
            |w: Who<'static>, password: &str| checker.check(w, phc.clone(), password.into());
        assert_eq!(
            check(who(here, "alice", "a"), "right").await,
            Verdict::Admitted
        );
        for _ in 0..3 {
            let v = check(who(here, "alice", "x"), "wrong").await;
            assert_eq!(v, Verdict::Refused, "free failures are checked");
        }
        let v = check(who(here, "alice", "x"), "wrong").await;
        assert_eq!(v, Verdict::Refused, "the fourth failure starts the hold");
        let v = check(who(here, "carol", "c"), "right").await;
        assert_eq!(v, Verdict::Busy, "a held-off address is refused unchecked");
        let v = check(who(elsewhere, "alice", "b"), "right").await;
        assert_eq!(v, Verdict::Busy, "a held-off username is refused unchecked");
        let v = check(who(here, "alice", "a"), "right").await;
        assert_eq!(
            v,
            Verdict::Admitted,
            "the client that logged in before gets in"
        );
    }
}
