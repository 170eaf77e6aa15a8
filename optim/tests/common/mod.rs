//! Helpers shared by the integration tests.

/// `n` elements starting `skip` elements past a page boundary (a `Vec`
/// starts 16 bytes past one).
pub struct PageAligned<T> {
    storage: Vec<T>,
    start: usize,
    n: usize,
}

impl<T: Clone> PageAligned<T> {
    pub fn new(n: usize, skip: usize, fill: T) -> PageAligned<T> {
        let size = std::mem::size_of::<T>();
        let storage = vec![fill; n + skip + 4096 / size];
        let address = storage.as_ptr() as usize;
        let start = (address.next_multiple_of(4096) - address) / size + skip;
        PageAligned { storage, start, n }
    }

    pub fn get(&self) -> &[T] {
        &self.storage[self.start..self.start + self.n]
    }

    pub fn get_mut(&mut self) -> &mut [T] {
        &mut self.storage[self.start..self.start + self.n]
    }
}

impl<T: Clone + PartialEq> PartialEq for PageAligned<T> {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}
