//! A rank's access to its tensors' copies: a guard on a copy in a tier
//! (fetched there on demand when the plan did not bring it), and the
//! backend's work on a device copy ordered after its arrival and fenced.

use strata_device::View;
use strata_kernels::Backend;
use strata_runtime::RuntimeError;
use strata_runtime::{Access, Guard, Runtime, TensorId, Tier};

use crate::error::Result;

/// A guard on the tensor's copy in `tier`, fetching it there first when it
/// is not (a demand fetch: the plan did not bring it, or a spill took it).
pub(super) fn guard(runtime: &Runtime, id: TensorId, tier: Tier, access: Access) -> Result<Guard> {
    loop {
        match runtime.acquire(id, tier, access) {
            Ok(guard) => return Ok(guard),
            Err(RuntimeError::NotResident { .. }) => match runtime.move_to(id, tier) {
                Ok(done) => done.wait()?,
                Err(RuntimeError::Moving { .. }) => {}
                Err(err) => return Err(err.into()),
            },
            Err(err) => return Err(err.into()),
        }
    }
}

/// Engine tensors the backend reads or writes in place live on the device.
const ON_DEVICE: &str = "the engine computes on device-tier copies";

/// Runs `read` on the backend over the device copy of `id` (fetched there
/// first when it is not), ordered after the copy's arrival, and hands the
/// copy the fence of that work.
pub(super) fn with_device_view<R>(
    runtime: &Runtime,
    backend: &dyn Backend,
    id: TensorId,
    dtype: strata_device::Dtype,
    read: impl FnOnce(View<'_>) -> Result<R>,
) -> Result<R> {
    let mut held = guard(runtime, id, Tier::Device, Access::Read)?;
    backend.wait(held.ready())?;
    let out = read(held.device_view(dtype).expect(ON_DEVICE))?;
    held.used_until(backend.record()?);
    Ok(out)
}

/// Writes `source` (as many elements as the tensor holds of `dtype`) whole
/// into the tensor's device copy, device to device on the compute stream,
/// without reading its old bytes: copied, or cast (rounded to nearest
/// even) where `dtype` is not the source's.
pub(super) fn write_from_view(
    runtime: &Runtime,
    backend: &dyn Backend,
    id: TensorId,
    source: View<'_>,
    dtype: strata_device::Dtype,
) -> Result<()> {
    runtime.overwrite_with(id, Tier::Device, |held| -> Result<()> {
        backend.wait(held.ready())?;
        let target = held.device_view_mut(dtype).expect(ON_DEVICE);
        match source.dtype() == dtype {
            true => backend.copy(source, target)?,
            false => backend.cast(source, target)?,
        }
        held.used_until(backend.record()?);
        Ok(())
    })
}
