//! `edgemeta-fakeapi`: the fake Kubernetes API server as a process, for the demo and for
//! `kubectl` by hand. Prints its URL, writes a kubeconfig if asked, runs until SIGINT/SIGTERM.
//!
//! Run with: `edgemeta-fakeapi --port 0 --kubeconfig /tmp/fake.kubeconfig`

use std::net::SocketAddr;
use std::time::Duration;

use edgemeta_fakeapi::{Config, FakeApi, KubeletClient, Lifecycle, DEFAULT_ADDRESS_TYPES};
use tokio_util::sync::CancellationToken;

fn usage() -> ! {
    eprintln!("usage: edgemeta-fakeapi [--port N] [--kubeconfig FILE] [--bookmark-interval-ms N] [--history N]\n\
               [--node-lifecycle] [--node-monitor-period-ms N] [--node-monitor-grace-period-ms N]\n\
               [--default-toleration-seconds N]\n\
               [--kubelet-client-certificate FILE --kubelet-client-key FILE --kubelet-certificate-authority FILE]\n\
               [--kubelet-preferred-address-types T,T,...] [--kubelet-dial HOST:PORT]");
    std::process::exit(2);
}

/// The kubelet client settings, started with kube-apiserver's defaults.
fn kubelet(config: &mut Config) -> &mut KubeletClient {
    config.kubelet.get_or_insert_with(|| KubeletClient {
        cert: Default::default(),
        key: Default::default(),
        ca: Default::default(),
        preferred_address_types: DEFAULT_ADDRESS_TYPES
            .iter()
            .map(|t| (*t).to_owned())
            .collect(),
        dial: None,
    })
}

fn main() {
    let mut config = Config::default();
    let mut kubeconfig = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--port" => {
                let port = value().parse().unwrap_or_else(|_| usage());
                config.address = SocketAddr::from(([127, 0, 0, 1], port));
            }
            "--kubeconfig" => kubeconfig = Some(value()),
            "--bookmark-interval-ms" => {
                config.bookmark_interval =
                    Duration::from_millis(value().parse().unwrap_or_else(|_| usage()));
            }
            "--history" => config.history = value().parse().unwrap_or_else(|_| usage()),
            // The simulated node lifecycle controller, at kube-controller-manager's defaults
            // unless the flags below shorten them (any of them also turns it on).
            "--node-lifecycle" => {
                config.lifecycle.get_or_insert_with(Lifecycle::default);
            }
            "--node-monitor-period-ms"
            | "--node-monitor-grace-period-ms"
            | "--default-toleration-seconds" => {
                let n: u64 = value().parse().unwrap_or_else(|_| usage());
                let lifecycle = config.lifecycle.get_or_insert_with(Lifecycle::default);
                match arg.as_str() {
                    "--node-monitor-period-ms" => {
                        lifecycle.monitor_period = Duration::from_millis(n.max(1));
                    }
                    "--node-monitor-grace-period-ms" => {
                        lifecycle.grace = Duration::from_millis(n);
                    }
                    _ => lifecycle.default_toleration = Duration::from_secs(n),
                }
            }
            // kube-apiserver's flags for reaching kubelets (`pods/log`).
            "--kubelet-client-certificate" => kubelet(&mut config).cert = value().into(),
            "--kubelet-client-key" => kubelet(&mut config).key = value().into(),
            "--kubelet-certificate-authority" => kubelet(&mut config).ca = value().into(),
            "--kubelet-preferred-address-types" => {
                kubelet(&mut config).preferred_address_types =
                    value().split(',').map(str::to_owned).collect();
            }
            "--kubelet-dial" => {
                kubelet(&mut config).dial = Some(value().parse().unwrap_or_else(|_| usage()));
            }
            _ => usage(),
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("edgemeta-fakeapi: {e}");
            std::process::exit(1);
        }
    };
    let code = runtime.block_on(async move {
        let cancel = CancellationToken::new();
        let api = match FakeApi::start(config, cancel.clone()).await {
            Ok(api) => api,
            Err(e) => {
                eprintln!("edgemeta-fakeapi: {e}");
                return 1;
            }
        };
        if let Some(path) = kubeconfig {
            if let Err(e) = std::fs::write(&path, api.kubeconfig()) {
                eprintln!("edgemeta-fakeapi: writing {path}: {e}");
                return 1;
            }
        }
        println!("{}", api.url());
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("edgemeta-fakeapi: {e}");
                    return 1;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        api.stop().await;
        0
    });
    std::process::exit(code);
}
