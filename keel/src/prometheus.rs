//! Prometheus text export of the metrics Keel records (feature `prometheus`).
//!
//! Workers count through the `metrics` facade and install no recorder; one call here
//! installs one that keeps the values and serves them as Prometheus text. The metric
//! names and their meaning are listed in the README.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Inside the tokio runtime that runs the worker:
//! keel::prometheus::serve("127.0.0.1:9464".parse()?)?;
//! // curl http://127.0.0.1:9464/metrics
//! # Ok(())
//! # }
//! ```

use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};

use metrics_exporter_prometheus::PrometheusBuilder;
pub use metrics_exporter_prometheus::PrometheusHandle;

/// The exporter could not be installed: a recorder is already installed in this process,
/// or the address cannot be bound.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot install the Prometheus exporter: {0}; install it once per process, on a free address"
)]
pub struct ExporterError(String);

/// Installs the process-wide recorder and serves its Prometheus text over HTTP on `addr`
/// (every path answers; scrape `/metrics`). Call it once, from inside a tokio runtime.
pub fn serve(addr: SocketAddr) -> Result<(), ExporterError> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|error| ExporterError(error.to_string()))
}

/// Installs the process-wide recorder without a listener, for a program that serves the
/// text from its own HTTP server: answer `/metrics` with [`PrometheusHandle::render`].
///
/// Calling it again returns the recorder the first call installed, so every part of a
/// program (or every server a test starts) may ask for the handle; it fails only when a
/// recorder other than this one is installed (by [`serve`], or by another library).
pub fn install() -> Result<PrometheusHandle, ExporterError> {
    static INSTALLED: Mutex<Option<PrometheusHandle>> = Mutex::new(None);
    let mut installed = INSTALLED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(handle) = installed.as_ref() {
        return Ok(handle.clone());
    }
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|error| ExporterError(error.to_string()))?;
    *installed = Some(handle.clone());
    Ok(handle)
}
