//! Ids by name over a table whose entries carry their names (values, nodes, models).
//!
//! The hash table holds only the 4-byte ids and compares names in the table itself, so a
//! million-entry index is a fraction of the size of a map with `&str` keys, and a lookup
//! touches fewer cache lines: resolving every node's inputs and outputs is a few million
//! lookups at DeepSeek-V3 scale.

use std::hash::BuildHasher;

use hashbrown::{hash_table::Entry, HashTable};
use rayon::prelude::*;
use rustc_hash::FxBuildHasher;

use crate::id::{EntityId, IdVec};

pub(crate) struct NameIndex<'t, I, T> {
    table: &'t IdVec<I, T>,
    name: fn(&T) -> &str,
    ids: HashTable<I>,
}

impl<'t, I: EntityId + Send + Sync, T: Sync> NameIndex<'t, I, T> {
    /// Indexes every entry of `table` by `name`; a repeated name is `Err` with that name.
    pub fn build(table: &'t IdVec<I, T>, name: fn(&T) -> &str) -> Result<Self, String> {
        let hashes: Vec<u64> = table
            .values()
            .as_slice()
            .par_iter()
            .map(|item| hash(name(item)))
            .collect();
        let mut ids = HashTable::with_capacity(table.len());
        for (id, item) in table.iter() {
            let key = name(item);
            let entry = ids.entry(
                hashes[id.index()],
                |&other: &I| name(&table[other]) == key,
                |&other: &I| hashes[other.index()],
            );
            match entry {
                Entry::Occupied(_) => return Err(key.to_owned()),
                Entry::Vacant(slot) => {
                    slot.insert(id);
                }
            }
        }
        Ok(NameIndex { table, name, ids })
    }

    pub fn get(&self, key: &str) -> Option<I> {
        self.get_hashed(key, hash(key))
    }

    /// [`NameIndex::get`] for a key whose [`hash`] is known.
    fn get_hashed(&self, key: &str, hash: u64) -> Option<I> {
        self.ids
            .find(hash, |&id| (self.name)(&self.table[id]) == key)
            .copied()
    }
}

fn hash(name: &str) -> u64 {
    FxBuildHasher.hash_one(name)
}

/// [`NameIndex::get`] for names met in execution order, trying first the ids met last, and
/// the id after the last output: a node mostly reads what the nodes just before it produced
/// and produces the values declared next, and those entries are still in cache. The recent
/// ids are kept with their names' hashes: a key is hashed once, compared with each of them as
/// a number, and the hash serves the table when none matches.
pub(crate) struct RecentFirst<'i, 't, I, T> {
    index: &'i NameIndex<'t, I, T>,
    recent: [Option<(u64, I)>; RECENT],
    next_slot: usize,
    last_output: Option<I>,
}

/// How many recent ids are tried before the hash table.
const RECENT: usize = 8;

impl<'i, 't, I: EntityId + Send + Sync, T: Sync> RecentFirst<'i, 't, I, T> {
    pub fn new(index: &'i NameIndex<'t, I, T>) -> Self {
        RecentFirst {
            index,
            recent: [None; RECENT],
            next_slot: 0,
            last_output: None,
        }
    }

    /// An input's id.
    pub fn input(&mut self, key: &str) -> Option<I> {
        let hash = hash(key);
        let hit = self
            .recent
            .iter()
            .flatten()
            .find(|&&(h, id)| h == hash && self.is(id, key))
            .map(|&(_, id)| id);
        hit.or_else(|| {
            let id = self.index.get_hashed(key, hash)?;
            self.remember(hash, id);
            Some(id)
        })
    }

    /// An output's id.
    pub fn output(&mut self, key: &str) -> Option<I> {
        let hash = hash(key);
        let next = self
            .last_output
            .map(|id| I::from_index(id.index() + 1))
            .filter(|&id| id.index() < self.index.table.len() && self.is(id, key));
        let id = next.or_else(|| self.index.get_hashed(key, hash))?;
        self.last_output = Some(id);
        self.remember(hash, id);
        Some(id)
    }

    fn is(&self, id: I, key: &str) -> bool {
        (self.index.name)(&self.index.table[id]) == key
    }

    fn remember(&mut self, hash: u64, id: I) {
        self.recent[self.next_slot] = Some((hash, id));
        self.next_slot = (self.next_slot + 1) % RECENT;
    }
}
