//! Typed entity ids and the dense tables they index.
//!
//! Every entity of a [`crate::Graph`] (node, value, model, a model's unit) is addressed by a `u32` newtype;
//! an id of one kind cannot index a table of another, and petgraph indices never leave the
//! crate.

use std::{fmt, marker::PhantomData, ops};

/// An entity id: a dense index into an [`IdVec`].
pub trait EntityId: Copy + Eq + Ord + fmt::Debug {
    fn from_index(index: usize) -> Self;
    fn index(self) -> usize;
}

macro_rules! entity_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(u32);

        impl EntityId for $name {
            fn from_index(index: usize) -> Self {
                // Graphs are limited to u32::MAX entities at load time.
                Self(u32::try_from(index).expect("entity index fits u32"))
            }
            fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({})"), self.0)
            }
        }
    };
}

entity_id!(
    /// A node, by its position in execution order.
    NodeId
);
entity_id!(
    /// A tensor value.
    ValueId
);
entity_id!(
    /// A model (a graph may hold several: a compose model's towers, an MTP block).
    ModelId
);
entity_id!(
    /// A recompute unit of one model, by its position in the model's declaration order.
    UnitId
);

/// A dense table keyed by an [`EntityId`] (cranelift's `PrimaryMap`/`SecondaryMap` in one).
#[derive(Clone, PartialEq, Eq)]
pub struct IdVec<I, T> {
    raw: Vec<T>,
    _id: PhantomData<fn(I) -> I>,
}

impl<I: EntityId, T> IdVec<I, T> {
    pub fn new() -> Self {
        Self::from_vec(Vec::new())
    }

    /// A table with one `value` per id in `0..len`.
    pub fn filled(len: usize, value: T) -> Self
    where
        T: Clone,
    {
        Self::from_vec(vec![value; len])
    }

    pub fn from_vec(raw: Vec<T>) -> Self {
        Self {
            raw,
            _id: PhantomData,
        }
    }

    /// Appends `value` and returns its id.
    pub fn push(&mut self, value: T) -> I {
        let id = I::from_index(self.raw.len());
        self.raw.push(value);
        id
    }

    pub fn len(&self) -> usize {
        self.raw.len()
    }

    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    pub fn get(&self, id: I) -> Option<&T> {
        self.raw.get(id.index())
    }

    pub fn ids(&self) -> impl DoubleEndedIterator<Item = I> + ExactSizeIterator {
        (0..self.raw.len()).map(I::from_index)
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (I, &T)> + ExactSizeIterator {
        self.raw
            .iter()
            .enumerate()
            .map(|(i, v)| (I::from_index(i), v))
    }

    pub fn values(&self) -> std::slice::Iter<'_, T> {
        self.raw.iter()
    }
}

impl<I: EntityId, T> Default for IdVec<I, T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<I: EntityId, T> ops::Index<I> for IdVec<I, T> {
    type Output = T;
    fn index(&self, id: I) -> &T {
        &self.raw[id.index()]
    }
}

impl<I: EntityId, T> ops::IndexMut<I> for IdVec<I, T> {
    fn index_mut(&mut self, id: I) -> &mut T {
        &mut self.raw[id.index()]
    }
}

impl<I: EntityId, T: fmt::Debug> fmt::Debug for IdVec<I, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}
