//! Mutual TLS on every gRPC connection between omni processes (issue 41).
//!
//! One cluster CA signs a certificate per process (`omnictl certs`). With
//! `--tls-ca`, `--tls-cert` and `--tls-key` a process installs them once at
//! its start ([`install`]); from then on every channel it opens
//! ([`endpoint`]) is TLS that presents its certificate and trusts only the
//! cluster CA, and every listener it serves ([`incoming`]) takes only peers
//! whose certificate that CA signed. Without them (one machine, `omnictl
//! up`) everything is plaintext as before. Process-wide rather than passed to
//! each of the ~20 places that dial or listen: a process is in one cluster,
//! and a forgotten call site must not quietly fall back to plaintext.
//!
//! What a certificate proves is membership of the cluster: every one names
//! [`CLUSTER_NAME`], which clients check instead of a host name, because
//! workers are reached at addresses only known at run time (Swarm's overlay
//! IPs, a registration's reported address). Its common name names the
//! process for the logs.
//!
//! The server side does its own handshakes (tokio-rustls) instead of
//! tonic's, so that a refused peer is said by name on this side too: the
//! log names its address and why (no certificate, another CA, not TLS),
//! and a plaintext gRPC caller is answered with `UNAUTHENTICATED` and the
//! reason rather than a dropped connection.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// The name every certificate of a cluster carries (a DNS subject
/// alternative name) and every client checks.
pub const CLUSTER_NAME: &str = "omni.cluster";

/// How often an idle connection is pinged, and how long a ping may go
/// unanswered before the connection counts as gone: a host cut off the
/// network (no FIN, no RST) is noticed within the sum on every channel and
/// listener, not after the kernel's two hours of TCP keepalive.
pub const KEEPALIVE: Duration = Duration::from_secs(5);

/// How long a peer has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS settings every service takes (flattened into its config, so
/// they come from `omni.toml`, `OMNI_<SERVICE>_TLS_*` or flags).
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsArgs {
    /// The cluster CA's certificate (PEM). With --tls-cert and --tls-key,
    /// every gRPC connection this process makes or takes is mutual TLS and
    /// a peer without a certificate this CA signed is refused; without the
    /// three, plaintext (one machine). `omnictl certs` makes them.
    #[arg(long = "tls-ca", value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM), signed by the cluster CA.
    #[arg(long = "tls-cert", value_name = "FILE", requires_all = ["tls_ca", "tls_key"])]
    pub tls_cert: Option<PathBuf>,
    /// This process's private key (PEM).
    #[arg(long = "tls-key", value_name = "FILE", requires_all = ["tls_ca", "tls_cert"])]
    pub tls_key: Option<PathBuf>,
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    // `error`, not `source`: the message says it once (a source would be
    // printed again by every `{:#}` of the chain).
    #[error("cannot read {what} {path}: {error}")]
    Read {
        what: &'static str,
        path: PathBuf,
        error: io::Error,
    },
    #[error("{what} {path} holds no PEM {kind}")]
    Empty {
        what: &'static str,
        path: PathBuf,
        kind: &'static str,
    },
    #[error("{what} {path} is not valid PEM: {msg}")]
    Pem {
        what: &'static str,
        path: PathBuf,
        msg: String,
    },
    #[error("the TLS settings are refused: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("the CA certificate cannot verify client certificates: {0}")]
    Verifier(String),
    #[error("TLS needs all three of --tls-ca, --tls-cert and --tls-key; {0} missing")]
    Partial(String),
    #[error("TLS is already set up differently in this process")]
    Twice,
}

/// A process's TLS, as [`install`] made it.
struct ClusterTls {
    client: ClientTlsConfig,
    acceptor: tokio_rustls::TlsAcceptor,
}

static TLS: OnceLock<Option<ClusterTls>> = OnceLock::new();

fn current() -> Option<&'static ClusterTls> {
    TLS.get().and_then(Option::as_ref)
}

/// Whether this process speaks TLS.
pub fn enabled() -> bool {
    current().is_some()
}

impl TlsArgs {
    /// Whether the three files are given.
    pub fn is_set(&self) -> bool {
        self.tls_ca.is_some() && self.tls_cert.is_some() && self.tls_key.is_some()
    }
}

/// Sets this process's TLS from `args` (plaintext when they are unset):
/// reads and checks the files now, so a bad one stops the process at its
/// start with the file named. Once per process; a second call with the
/// same kind of setting is a no-op.
pub fn install(args: &TlsArgs) -> Result<(), TlsError> {
    let missing: Vec<&str> = [
        ("--tls-ca", &args.tls_ca),
        ("--tls-cert", &args.tls_cert),
        ("--tls-key", &args.tls_key),
    ]
    .iter()
    .filter(|(_, v)| v.is_none())
    .map(|(f, _)| *f)
    .collect();
    if !missing.is_empty() && missing.len() < 3 {
        return Err(TlsError::Partial(missing.join(" and ")));
    }
    let tls = if args.is_set() {
        let ca = args.tls_ca.as_deref().expect("is_set");
        let cert = args.tls_cert.as_deref().expect("is_set");
        let key = args.tls_key.as_deref().expect("is_set");
        Some(load(ca, cert, key)?)
    } else {
        None
    };
    let on = tls.is_some();
    if TLS.set(tls).is_err() && enabled() != on {
        return Err(TlsError::Twice);
    }
    if let (true, Some(ca), Some(cert)) = (on, &args.tls_ca, &args.tls_cert) {
        tracing::info!(
            "mutual TLS on: every gRPC connection this process makes or takes needs a certificate from the CA in {} (this process's: {})",
            ca.display(),
            cert.display()
        );
    }
    Ok(())
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|error| TlsError::Read {
        what,
        path: path.to_path_buf(),
        error,
    })
}

fn load(ca: &Path, cert: &Path, key: &Path) -> Result<ClusterTls, TlsError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let pem_err = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |e: rustls::pki_types::pem::Error| TlsError::Pem {
            what,
            path,
            msg: e.to_string(),
        }
    };
    let certs = |what: &'static str, path: &Path, bytes: &[u8]| {
        let v = CertificateDer::pem_slice_iter(bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(pem_err(what, path))?;
        if v.is_empty() {
            return Err(TlsError::Empty {
                what,
                path: path.to_path_buf(),
                kind: "certificate",
            });
        }
        Ok(v)
    };
    let (ca_pem, cert_pem, key_pem) = (
        read("CA certificate", ca)?,
        read("certificate", cert)?,
        read("private key", key)?,
    );
    let ca_certs = certs("CA certificate", ca, &ca_pem)?;
    let chain = certs("certificate", cert, &cert_pem)?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::Empty {
            what: "private key",
            path: key.to_path_buf(),
            kind: "private key",
        },
        e => pem_err("private key", key)(e),
    })?;

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in ca_certs {
        roots.add(c)?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .map_err(|e| TlsError::Verifier(e.to_string()))?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, private)?;
    server.alpn_protocols = vec![b"h2".to_vec()];

    let client = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&ca_pem))
        .identity(Identity::from_pem(&cert_pem, &key_pem))
        .domain_name(CLUSTER_NAME);
    Ok(ClusterTls {
        client,
        acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
    })
}

/// A channel's endpoint to `addr` (`host:port`, or a URL whose scheme is
/// replaced): TLS with the cluster's credentials when this process has
/// them, and keepalive pings (see [`KEEPALIVE`]) either way.
pub fn endpoint(addr: &str) -> Result<Endpoint, tonic::transport::Error> {
    let host = addr
        .strip_prefix("http://")
        .or_else(|| addr.strip_prefix("https://"))
        .unwrap_or(addr);
    let ep = match current() {
        None => Endpoint::from_shared(format!("http://{host}"))?,
        Some(t) => {
            Endpoint::from_shared(format!("https://{host}"))?.tls_config(t.client.clone())?
        }
    };
    Ok(ep
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(KEEPALIVE)
        .keep_alive_while_idle(true))
}

/// A gRPC server builder with the listeners' keepalive (see [`KEEPALIVE`]);
/// serve it [`incoming`] connections.
pub fn server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE))
}

/// The connections `listener` takes, for `Server::serve_with_incoming`:
/// plain TCP without TLS; with it, only peers that finished a handshake
/// with a certificate the cluster CA signed (the others are logged with
/// their address and why, and a plaintext gRPC caller is told).
pub fn incoming(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = io::Result<Conn>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Conn>>(16);
    tokio::spawn(async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: the listener lives on.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let Some(tls) = current() else {
                if tx.send(Ok(Conn::Plain(stream))).await.is_err() {
                    return;
                }
                continue;
            };
            let to = tx.clone();
            tokio::spawn(async move {
                if let Some(conn) = handshake(tls, stream, peer).await {
                    let _ = to.send(Ok(conn)).await;
                }
            });
            if tx.is_closed() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Accepts a peer that speaks TLS with a certificate of the cluster;
/// refuses anyone else, saying why.
async fn handshake(
    tls: &'static ClusterTls,
    stream: TcpStream,
    peer: std::net::SocketAddr,
) -> Option<Conn> {
    let mut first = [0u8; 1];
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.peek(&mut first)).await {
        Ok(Ok(1..)) => {}
        _ => return None,
    }
    // A TLS record starts with its content type, 22 for a handshake.
    if first[0] != 22 {
        tracing::warn!(
            "refused a plaintext connection from {peer}: this process requires mutual TLS \
             (the peer has no --tls-ca/--tls-cert/--tls-key)"
        );
        tokio::spawn(refuse_plaintext(stream));
        return None;
    }
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.acceptor.accept(stream)).await {
        Ok(Ok(s)) => Some(Conn::Tls(Box::new(s))),
        Ok(Err(e)) => {
            tracing::warn!(
                "refused a TLS connection from {peer}: {}",
                handshake_error(&e)
            );
            None
        }
        Err(_) => {
            tracing::warn!(
                "refused a TLS connection from {peer}: no handshake within {HANDSHAKE_TIMEOUT:?}"
            );
            None
        }
    }
}

/// A failed handshake as the operator needs to read it.
fn handshake_error(e: &io::Error) -> String {
    use rustls::{CertificateError, Error};
    let Some(r) = e.get_ref().and_then(|i| i.downcast_ref::<Error>()) else {
        return e.to_string();
    };
    match r {
        Error::NoCertificatesPresented => {
            "it presented no certificate (a peer needs the cluster's --tls-cert and --tls-key)"
                .into()
        }
        Error::InvalidCertificate(CertificateError::UnknownIssuer)
        | Error::InvalidCertificate(CertificateError::BadSignature) => {
            "its certificate is not signed by this cluster's CA (another cluster's, or a \
             wrong --tls-ca)"
                .into()
        }
        Error::InvalidCertificate(CertificateError::Expired) => {
            "its certificate has expired (make new ones with `omnictl certs`)".into()
        }
        Error::AlertReceived(a) => format!(
            "it refused this process's certificate ({a:?}): it trusts another CA (check its --tls-ca)"
        ),
        r => r.to_string(),
    }
}

/// The one message a plaintext caller gets from a TLS listener.
pub const PLAINTEXT_REFUSED: &str =
    "this omni process requires mutual TLS: the caller has no TLS settings \
     (give it the cluster's --tls-ca, --tls-cert and --tls-key)";

/// Answers every gRPC call on a plaintext HTTP/2 connection with
/// `UNAUTHENTICATED` and [`PLAINTEXT_REFUSED`], so a caller without TLS
/// reads why instead of a reset connection.
async fn refuse_plaintext(stream: TcpStream) {
    use tonic::codegen::http;
    let svc = hyper::service::service_fn(|_req| async {
        let code = (tonic::Code::Unauthenticated as i32).to_string();
        http::Response::builder()
            .status(200)
            .header("content-type", "application/grpc")
            .header("grpc-status", code)
            .header("grpc-message", PLAINTEXT_REFUSED)
            .body(tonic::body::Body::empty())
    });
    let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    let _ = tokio::time::timeout(HANDSHAKE_TIMEOUT, conn).await;
}

/// Words for an error on a client connection, its causes included, with a
/// hint where TLS is the likely reason (tonic's own `Display` of a transport
/// error is only "transport error").
pub fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut src = e.source();
    while let Some(s) = src {
        let t = s.to_string();
        if !parts.iter().any(|p| p.contains(&t)) {
            parts.push(t);
        }
        src = s.source();
    }
    let text = parts.join(": ");
    let hint = if text.contains("InvalidContentType") || text.contains("corrupt message") {
        Some("the peer does not speak TLS: it runs without the cluster's TLS settings")
    } else if text.contains("UnknownIssuer") || text.contains("BadSignature") {
        Some("the peer's certificate is not signed by this cluster's CA")
    } else if text.contains("NotValidForName") {
        Some("the peer's certificate is not an omni cluster certificate (`omnictl certs` makes them)")
    } else if text.contains("fatal alert")
        || (enabled()
            && ["broken pipe", "connection reset", "connection closed"]
                .iter()
                .any(|w| text.contains(w)))
    {
        // TLS 1.3 checks the client's certificate after the client's part
        // of the handshake: a refusal reaches it as an alert, or, as the
        // race goes, only as a closed connection.
        Some(
            "the peer ended the TLS session: it may not trust this process's certificate \
             (its log says why)",
        )
    } else if !enabled() && (text.contains("h2 protocol error") || text.contains("frame")) {
        Some("the peer may require mutual TLS (give this process --tls-ca, --tls-cert, --tls-key)")
    } else {
        None
    };
    match hint {
        Some(h) => format!("{text} ({h})"),
        None => text,
    }
}

/// A connection a server takes: plain TCP, or TLS over it.
pub enum Conn {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            Conn::Plain(s) => s.connect_info(),
            Conn::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
