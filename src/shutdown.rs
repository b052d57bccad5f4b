//! Resolves on the first SIGINT (Ctrl-C) or SIGTERM; shared by `edgemeta` and
//! `edgemeta-edgecontroller`.

/// Waits for a stop signal.
pub async fn signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received"),
        _ = terminate => tracing::info!("SIGTERM received"),
    }
}

/// Runs `job` on a runtime of its own, with a token cancelled on SIGINT/SIGTERM (the separate
/// processes `edgemeta edged` and `edgemeta-edgecontroller` stop this way).
pub fn until_signal<F, Fut, T, E>(thread_name: &str, job: F) -> anyhow::Result<T>
where
    F: FnOnce(tokio_util::sync::CancellationToken) -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    anyhow::Error: From<E>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(thread_name)
        .build()?;
    let result = runtime.block_on(async move {
        let cancel = tokio_util::sync::CancellationToken::new();
        let stop = cancel.clone();
        tokio::spawn(async move {
            signal().await;
            stop.cancel();
        });
        job(cancel).await
    });
    Ok(result?)
}
