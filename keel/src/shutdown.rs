//! The stop request of a process: Ctrl-C everywhere, SIGTERM on Unix as well.

/// Resolves when the process is asked to stop: Ctrl-C (SIGINT), or SIGTERM on Unix
/// (what `kill`, systemd and container runtimes send). Use it to end a program's own work
/// and then shut its worker down:
///
/// ```no_run
/// # async fn demo(keel: keel::Keel) -> Result<(), keel::Error> {
/// let worker = keel.worker().spawn()?;
/// keel::shutdown_signal().await;
/// let stats = worker.shutdown().await;
/// println!("{} steps committed", stats.committed());
/// # Ok(()) }
/// ```
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C; waiting for SIGTERM only");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM; waiting for Ctrl-C only");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
