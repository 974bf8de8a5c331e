//! Meshes of named dimensions built from splits.

use std::sync::Arc;

use crate::{CommBackend, CommError, Communicator, Result};

/// Ranks arranged in an N-D grid with named dimensions (row-major: the last
/// dimension varies fastest), with one sub-communicator per dimension: the
/// ranks that differ only in that coordinate.
///
/// `Mesh::new(&world, &[("replicate", 2), ("shard", 4)])` on 8 ranks gives
/// rank 5 the coordinates (1, 1), a "shard" communicator of ranks 4..8 and a
/// "replicate" communicator of ranks 1 and 5.
pub struct Mesh<C: CommBackend> {
    dims: Vec<(String, usize)>,
    coords: Vec<usize>,
    comms: Vec<Arc<Communicator<C>>>,
}

impl<C: CommBackend> std::fmt::Debug for Mesh<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mesh({:?} at {:?})", self.dims, self.coords)
    }
}

impl<C: CommBackend> Mesh<C> {
    /// Builds the mesh; every rank of `world` must call it with the same dims.
    pub fn new(world: &Communicator<C>, dims: &[(&str, usize)]) -> Result<Mesh<C>> {
        let op = "Mesh::new";
        if dims.is_empty() {
            return Err(CommError::invalid(op, "a mesh needs at least one dimension"));
        }
        let mut product = 1usize;
        for (i, (name, size)) in dims.iter().enumerate() {
            if name.is_empty() || dims[..i].iter().any(|(n, _)| n == name) {
                return Err(CommError::invalid(op, format!("dimension names must be unique and non-empty: {dims:?}")));
            }
            if *size == 0 {
                return Err(CommError::invalid(op, format!("dimension `{name}` has size 0")));
            }
            product = product.saturating_mul(*size);
        }
        if product != world.size() {
            return Err(CommError::invalid(
                op,
                format!("{dims:?} has {product} ranks but the world has {}", world.size()),
            ));
        }
        let sizes: Vec<usize> = dims.iter().map(|d| d.1).collect();
        let mut coords = vec![0; dims.len()];
        let mut rest = world.rank();
        for d in (0..dims.len()).rev() {
            coords[d] = rest % sizes[d];
            rest /= sizes[d];
        }
        let mut comms = Vec::with_capacity(dims.len());
        for d in 0..dims.len() {
            // Ranks that agree on every other coordinate share a color.
            let mut color = 0u64;
            for (e, c) in coords.iter().enumerate().filter(|(e, _)| *e != d) {
                color = color * sizes[e] as u64 + *c as u64;
            }
            let color = u32::try_from(color).map_err(|_| CommError::invalid(op, "mesh too large"))?;
            let comm = world
                .split(Some(color), coords[d] as i64)?
                .ok_or_else(|| CommError::invalid(op, "split returned no communicator"))?;
            comms.push(Arc::new(comm));
        }
        Ok(Mesh { dims: dims.iter().map(|(n, s)| (n.to_string(), *s)).collect(), coords, comms })
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.dims
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| CommError::invalid("Mesh", format!("no dimension `{name}` in {:?}", self.dims)))
    }

    /// The communicator along dimension `name`.
    pub fn comm(&self, name: &str) -> Result<&Arc<Communicator<C>>> {
        Ok(&self.comms[self.index(name)?])
    }

    /// This rank's coordinate along `name`.
    pub fn coord(&self, name: &str) -> Result<usize> {
        Ok(self.coords[self.index(name)?])
    }

    /// The size of dimension `name`.
    pub fn dim_size(&self, name: &str) -> Result<usize> {
        Ok(self.dims[self.index(name)?].1)
    }

    /// The dimensions, in order.
    pub fn dims(&self) -> &[(String, usize)] {
        &self.dims
    }

    /// This rank's coordinates, in dimension order.
    pub fn coords(&self) -> &[usize] {
        &self.coords
    }
}
