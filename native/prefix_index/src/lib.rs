//! The approximate prefix-cache scorer's index and block hashing, native.
//!
//! Why native: at long prompts the scorer walks up to `maxPrefixBlocksToMatch` (256) block
//! hashes three times per request (match, the last-use snapshot, add), and in Python that
//! was a fifth of the EPP's CPU per 220 KB request (measured with benchmarks/epp_overhead.py). The
//! scorer itself, its parameters and its calibration stay Python
//! (`epp/scheduling/plugins/prefix.py`); this module is its data structure only, with the
//! same methods and results as the Python `PythonPrefixIndex` it replaces when built (a
//! differential test runs both on the same random operations).
//!
//! The index: block hash -> the servers holding it, and per server an LRU of its hashes,
//! each entry holding the sequence number of its last use (one counter for the index),
//! so `drop_older_than` removes everything an LRU engine must have evicted before a block.
//! Servers are numbered on first sight; a cleared server's number is never reused.

use std::collections::HashMap;

use hashlink::LinkedHashMap;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use xxhash_rust::xxh64::Xxh64;

type Lru = LinkedHashMap<u64, u64>;

/// Chained xxh64 of `data` cut into `block_chars`-byte blocks (the last one partial),
/// over at most `block_chars * max_blocks` bytes: `h[i] = xxh64(block[i] ||
/// le64(h[i-1]))`, `h[-1] = xxh64(seed)` (the model and cache salt). Empty when `data` is
/// shorter than one block. The same values as the Python `block_hashes`, packed: `bytes`
/// of little-endian u64s, which the index's methods take back as they are (a Python int
/// per hash, made here and read back by three methods, was a fiftieth of a 220 KB
/// request's CPU).
#[pyfunction]
fn block_hashes<'py>(
    py: Python<'py>,
    seed: &[u8],
    data: &[u8],
    block_chars: usize,
    max_blocks: usize,
) -> Bound<'py, PyBytes> {
    if block_chars == 0 || data.len() < block_chars {
        return PyBytes::new(py, b"");
    }
    let data = &data[..data.len().min(block_chars.saturating_mul(max_blocks))];
    let blocks = data.len().div_ceil(block_chars);
    let mut previous = xxhash_rust::xxh64::xxh64(seed, 0);
    let mut chunks = data.chunks(block_chars);
    PyBytes::new_with(py, blocks * 8, |out| {
        for slot in out.chunks_exact_mut(8) {
            let mut hasher = Xxh64::new(0);
            hasher.update(chunks.next().unwrap_or_default());
            hasher.update(&previous.to_le_bytes());
            previous = hasher.digest();
            slot.copy_from_slice(&previous.to_le_bytes());
        }
        Ok(())
    })
    .expect("bytes of a known size")
}

/// The hashes a method was given: packed `bytes` (what `block_hashes` returns, and an
/// admission record's `prefix`) or a sequence of ints.
fn hashes_of(value: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(packed) = value.cast::<PyBytes>() {
        let data = packed.as_bytes();
        if data.len() % 8 != 0 {
            return Err(PyValueError::new_err(format!(
                "packed hashes are whole little-endian u64s; got {} bytes",
                data.len()
            )));
        }
        return Ok(data
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect());
    }
    value.extract()
}

/// Block hash -> servers holding it, with a bounded LRU per server.
#[pyclass(module = "infergate.epp.scheduling._prefix_index")]
struct PrefixIndex {
    /// Entries per server whose capacity was never set.
    #[pyo3(get, set, name = "capacity")]
    default_capacity: usize,
    ids: HashMap<String, u32>,
    names: HashMap<u32, String>,
    capacities: HashMap<u32, usize>,
    lrus: HashMap<u32, Lru>,
    holders: HashMap<u64, Vec<u32>>,
    seq: u64,
    next_id: u32,
}

impl PrefixIndex {
    fn id(&self, server: &str) -> Option<u32> {
        self.ids.get(server).copied()
    }

    fn id_or_new(&mut self, server: &str) -> u32 {
        if let Some(id) = self.id(server) {
            return id;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.ids.insert(server.to_owned(), id);
        self.names.insert(id, server.to_owned());
        id
    }

    fn cap(&self, id: u32) -> usize {
        self.capacities
            .get(&id)
            .copied()
            .unwrap_or(self.default_capacity)
    }

    /// Records `n` matched blocks for each of `ids`, by name.
    fn name_counts(&self, ids: &[u32], n: usize, out: &mut HashMap<String, usize>) {
        for id in ids {
            if let Some(name) = self.names.get(id) {
                out.insert(name.clone(), n);
            }
        }
    }

    fn discard(holders: &mut HashMap<u64, Vec<u32>>, h: u64, id: u32) {
        if let Some(servers) = holders.get_mut(&h) {
            servers.retain(|&s| s != id);
            if servers.is_empty() {
                holders.remove(&h);
            }
        }
    }
}

#[pymethods]
impl PrefixIndex {
    #[new]
    #[pyo3(signature = (capacity_per_server))]
    fn new(capacity_per_server: usize) -> Self {
        PrefixIndex {
            default_capacity: capacity_per_server,
            ids: HashMap::new(),
            names: HashMap::new(),
            capacities: HashMap::new(),
            lrus: HashMap::new(),
            holders: HashMap::new(),
            seq: 0,
            next_id: 0,
        }
    }

    /// Bound `server`'s LRU to `blocks` entries (at least 1), evicting now if it shrank.
    fn set_capacity(&mut self, server: &str, blocks: i64) {
        let blocks = blocks.max(1) as usize;
        let id = self.id_or_new(server);
        if self.capacities.get(&id) == Some(&blocks) {
            return;
        }
        self.capacities.insert(id, blocks);
        if let Some(lru) = self.lrus.get_mut(&id) {
            while lru.len() > blocks {
                if let Some((old, _)) = lru.pop_front() {
                    Self::discard(&mut self.holders, old, id);
                }
            }
        }
    }

    fn capacity_of(&self, server: &str) -> usize {
        self.id(server)
            .map_or(self.default_capacity, |id| self.cap(id))
    }

    /// Records `hashes` as `server`'s most recent entries, in order (each use takes the
    /// next sequence number); past its capacity the least recently used go.
    fn add(&mut self, server: &str, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let hashes = hashes_of(hashes)?;
        let id = self.id_or_new(server);
        let capacity = self.cap(id);
        let lru = self.lrus.entry(id).or_default();
        for h in hashes {
            self.seq += 1;
            if let Some(used) = lru.get_mut(&h) {
                *used = self.seq;
                lru.to_back(&h);
                continue;
            }
            lru.insert(h, self.seq);
            self.holders.entry(h).or_default().push(id);
            if lru.len() > capacity {
                if let Some((old, _)) = lru.pop_front() {
                    Self::discard(&mut self.holders, old, id);
                }
            }
        }
        Ok(())
    }

    fn last_use(&self, server: &str, h: u64) -> Option<u64> {
        let id = self.id(server)?;
        self.lrus.get(&id)?.get(&h).copied()
    }

    /// `last_use` of each hash, 0 where `server` does not hold it.
    fn last_uses(&self, server: &str, hashes: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let lru = self.id(server).and_then(|id| self.lrus.get(&id));
        Ok(hashes_of(hashes)?
            .iter()
            .map(|h| lru.and_then(|lru| lru.get(h).copied()).unwrap_or(0))
            .collect())
    }

    /// Drops `server`'s entries last used at or before `seq`; returns how many.
    fn drop_older_than(&mut self, server: &str, seq: u64) -> usize {
        let Some(id) = self.id(server) else { return 0 };
        let Some(lru) = self.lrus.get_mut(&id) else {
            return 0;
        };
        let mut dropped = 0;
        while let Some((&h, &used)) = lru.front() {
            if used > seq {
                break;
            }
            lru.pop_front();
            Self::discard(&mut self.holders, h, id);
            dropped += 1;
        }
        dropped
    }

    fn remove(&mut self, server: &str, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let hashes = hashes_of(hashes)?;
        let Some(id) = self.id(server) else { return Ok(()) };
        let Some(lru) = self.lrus.get_mut(&id) else {
            return Ok(());
        };
        for h in hashes {
            if lru.remove(&h).is_some() {
                Self::discard(&mut self.holders, h, id);
            }
        }
        Ok(())
    }

    /// Forgets `server`: its entries and its capacity.
    fn clear_server(&mut self, server: &str) {
        let Some(id) = self.id(server) else { return };
        if let Some(lru) = self.lrus.remove(&id) {
            for (h, _) in lru {
                Self::discard(&mut self.holders, h, id);
            }
        }
        self.capacities.remove(&id);
        if let Some(name) = self.names.remove(&id) {
            self.ids.remove(&name);
        }
    }

    /// Per server, how many leading blocks of `hashes` it holds (servers holding none
    /// are left out). The servers still matching after block `i` are the intersection
    /// of the holders of blocks `0..=i`; one that drops out at block `i` held `i`
    /// blocks, and those left at the end held every block walked. Each server's count is
    /// written once, when it drops out or at the end (not once per block).
    #[pyo3(name = "match")]
    fn match_(&self, hashes: &Bound<'_, PyAny>) -> PyResult<HashMap<String, usize>> {
        let hashes = hashes_of(hashes)?;
        let mut out = HashMap::new();
        let mut alive: Vec<u32> = Vec::new();
        let mut walked = 0;
        for (i, h) in hashes.iter().enumerate() {
            let Some(holders) = self.holders.get(h) else {
                break;
            };
            if i == 0 {
                alive.extend_from_slice(holders);
            } else {
                alive.retain(|&s| {
                    let held = holders.contains(&s);
                    if !held {
                        self.name_counts(&[s], i, &mut out); // it held blocks 0..i
                    }
                    held
                });
            }
            if alive.is_empty() {
                break;
            }
            walked = i + 1;
        }
        self.name_counts(&alive, walked, &mut out);
        Ok(out)
    }

    fn size(&self, server: &str) -> usize {
        self.id(server)
            .and_then(|id| self.lrus.get(&id))
            .map_or(0, |lru| lru.len())
    }

    /// Servers that hold or held entries (not those with only a capacity set).
    fn servers(&self) -> Vec<String> {
        self.lrus
            .keys()
            .filter_map(|id| self.names.get(id).cloned())
            .collect()
    }
}

#[pymodule]
fn _prefix_index(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_class::<PrefixIndex>()?;
    Ok(())
}
