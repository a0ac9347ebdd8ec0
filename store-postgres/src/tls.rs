//! TLS for the store's connections, with libpq's `sslmode` meanings.
//!
//! The driver knows only `disable`, `prefer` and `require`, and refuses parameters it does
//! not know, so the store reads `sslmode` and `sslrootcert` from the connection string
//! itself, hands the driver the rest, and builds the rustls connector every connection
//! (pooled, listening, migrating) goes through:
//!
//! | `sslmode` | TLS | server certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (the default) | when the server offers it, else plain | not verified |
//! | `require` | always, or the connection fails | not verified |
//! | `verify-ca` | always | chain checked against the roots |
//! | `verify-full` | always | chain and host name checked |
//!
//! The roots are the PEM file `sslrootcert` names, else the system's store. As with libpq,
//! naming a `sslrootcert` under `prefer` or `require` checks the chain too. A certificate
//! that is not verified still has to prove, by its handshake signature, that the server
//! holds its key: the encryption is real, only who the server is goes unchecked.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_core::{StoreError, StoreResult};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

/// How a connection uses TLS: libpq's `sslmode` values (`allow`, which prefers a plain
/// connection, is not offered).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// TLS when the server offers it, else a plain connection; the certificate is not
    /// verified. The default.
    #[default]
    Prefer,
    /// TLS or no connection; the certificate is not verified.
    Require,
    /// TLS, and the server's certificate chain must lead to a trusted root.
    VerifyCa,
    /// As `VerifyCa`, and the certificate must name the host connected to.
    VerifyFull,
}

impl SslMode {
    /// The `sslmode` value for `s`, or an error listing the accepted ones.
    pub fn parse(s: &str) -> StoreResult<Self> {
        match s {
            "disable" => Ok(SslMode::Disable),
            "prefer" => Ok(SslMode::Prefer),
            "require" => Ok(SslMode::Require),
            "verify-ca" => Ok(SslMode::VerifyCa),
            "verify-full" => Ok(SslMode::VerifyFull),
            other => Err(StoreError::invalid(format!(
                "url: sslmode={other} is not supported; use disable, prefer, require, verify-ca or verify-full"
            ))),
        }
    }

    /// The value as written in a URL.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// The nearest mode the driver knows; the verification is the connector's.
    fn driver(self) -> tokio_postgres::config::SslMode {
        match self {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a connection string asks of TLS.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct TlsSettings {
    pub(crate) mode: SslMode,
    pub(crate) root_cert: Option<PathBuf>,
}

/// Splits `sslmode` and `sslrootcert` off a connection string (a URL or libpq's
/// `key=value` form): the settings, and the string the driver is given. A string that
/// cannot be read is handed on whole, for the driver to report.
pub(crate) fn split(conn: &str) -> StoreResult<(String, TlsSettings)> {
    let taken = if conn.starts_with("postgres://") || conn.starts_with("postgresql://") {
        split_url(conn)
    } else {
        split_key_value(conn)
    };
    let Some((rest, pairs)) = taken else { return Ok((conn.to_owned(), TlsSettings::default())) };
    let mut settings = TlsSettings::default();
    for (key, value) in pairs {
        match key.as_str() {
            "sslmode" => settings.mode = SslMode::parse(&value)?,
            _ if value.is_empty() => settings.root_cert = None,
            _ => settings.root_cert = Some(PathBuf::from(value)),
        }
    }
    Ok((rest, settings))
}

/// Whether the store reads this parameter itself.
fn ours(key: &str) -> bool {
    key == "sslmode" || key == "sslrootcert"
}

/// A URL without its TLS parameters, and those parameters (values percent-decoded).
fn split_url(url: &str) -> Option<(String, Vec<(String, String)>)> {
    let Some((base, query)) = url.split_once('?') else { return Some((url.to_owned(), vec![])) };
    let mut kept = Vec::new();
    let mut taken = Vec::new();
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if ours(key) {
            taken.push((key.to_owned(), percent_decode(value)?));
        } else if !pair.is_empty() {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    Some((rest, taken))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A `key=value` string without its TLS pairs, and those pairs (values unquoted), read as
/// libpq reads it: values may be single-quoted, and `\` escapes the next character.
fn split_key_value(conn: &str) -> Option<(String, Vec<(String, String)>)> {
    let mut kept = String::with_capacity(conn.len());
    let mut taken = Vec::new();
    let mut chars = conn.char_indices().peekable();
    loop {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, _)) = chars.peek() else { break };
        let mut key = String::new();
        while let Some((_, c)) = chars.next_if(|(_, c)| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        chars.next_if(|(_, c)| *c == '=')?;
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if(|(_, c)| *c == '\'').is_some() {
            loop {
                match chars.next()? {
                    (_, '\'') => break,
                    (_, '\\') => value.push(chars.next()?.1),
                    (_, c) => value.push(c),
                }
            }
        } else {
            while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace()) {
                if c == '\\' {
                    value.push(chars.next()?.1);
                } else {
                    value.push(c);
                }
            }
        }
        let end = chars.peek().map_or(conn.len(), |&(i, _)| i);
        if ours(&key) {
            taken.push((key, value));
        } else {
            if !kept.is_empty() {
                kept.push(' ');
            }
            kept.push_str(conn[start..end].trim_end());
        }
    }
    Some((kept, taken))
}

impl TlsSettings {
    /// Sets the driver's mode for these settings.
    pub(crate) fn apply(&self, pg: &mut tokio_postgres::Config) {
        pg.ssl_mode(self.mode.driver());
    }

    /// The connector every connection of the store uses. Reads the roots now, so a bad
    /// `sslrootcert` fails the connect that names it.
    pub(crate) fn connector(&self) -> StoreResult<MakeRustlsConnect> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let verify = match (self.mode, &self.root_cert) {
            (SslMode::Disable, _) | (SslMode::Prefer | SslMode::Require, None) => false,
            (SslMode::VerifyCa | SslMode::VerifyFull, _) | (_, Some(_)) => true,
        };
        let chain = if verify {
            let (roots, from) = self.roots()?;
            let inner =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| StoreError::invalid(format!("tls: {e}")))?;
            Some(Chain { inner, roots: from })
        } else {
            None
        };
        let verifier = Arc::new(Verifier {
            chain,
            mode: self.mode,
            algorithms: provider.signature_verification_algorithms,
        });
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::invalid(format!("tls: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(MakeRustlsConnect::new(config))
    }

    /// The trusted roots and where they came from (for messages).
    fn roots(&self) -> StoreResult<(RootCertStore, String)> {
        let mut roots = RootCertStore::empty();
        if let Some(path) = &self.root_cert {
            let certs = read_pem(path)?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(root_file_error(
                    path,
                    "none of its certificates can serve as a root (not X.509)",
                ));
            }
            return Ok((roots, format!("sslrootcert={}", path.display())));
        }
        let found = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(found.certs);
        if roots.is_empty() {
            let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
            let why =
                if errors.is_empty() { String::new() } else { format!(" ({})", errors.join("; ")) };
            return Err(StoreError::invalid(format!(
                "url: sslmode={} needs root certificates, and none were found on this system{why}; \
                 give sslrootcert=<PEM file of the certificate authority>",
                self.mode
            )));
        }
        Ok((roots, "the system's root certificates".to_owned()))
    }
}

/// The certificates of a PEM file.
fn read_pem(path: &Path) -> StoreResult<Vec<CertificateDer<'static>>> {
    let bytes =
        std::fs::read(path).map_err(|e| root_file_error(path, &format!("cannot read it: {e}")))?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|e| root_file_error(path, &format!("not a PEM file: {e}")))?;
    if certs.is_empty() {
        return Err(root_file_error(
            path,
            "holds no PEM certificate (a `-----BEGIN CERTIFICATE-----` block)",
        ));
    }
    Ok(certs)
}

fn root_file_error(path: &Path, why: &str) -> StoreError {
    StoreError::invalid(format!(
        "url: sslrootcert={}: {why}; name a PEM file holding the certificate of the authority \
         that signed the server's certificate",
        path.display()
    ))
}

/// How the server's certificate is checked. Without a chain to check it accepts any
/// certificate; either way the server must sign the handshake with the certificate's key,
/// so the connection is encrypted to whoever holds it.
#[derive(Debug)]
struct Verifier {
    /// The chain check, when the mode or a `sslrootcert` asks for one.
    chain: Option<Chain>,
    mode: SslMode,
    algorithms: WebPkiSupportedAlgorithms,
}

/// The WebPKI verifier and where its roots came from (for messages).
#[derive(Debug)]
struct Chain {
    inner: Arc<WebPkiServerVerifier>,
    roots: String,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else { return Ok(ServerCertVerified::assertion()) };
        // The chain is checked before the name, so a name error means the chain held;
        // below `verify-full` the name is not checked.
        match chain.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Ok(verified) => Ok(verified),
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if self.mode != SslMode::VerifyFull => Ok(ServerCertVerified::assertion()),
            Err(e) => Err(refusal(self.mode, &chain.roots, server_name, &e)),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// A refusal of the server's certificate, saying which `sslmode` refused and what to do.
fn refusal(
    mode: SslMode,
    roots: &str,
    server_name: &ServerName<'_>,
    e: &rustls::Error,
) -> rustls::Error {
    let host = server_name.to_str();
    let message = match e {
        rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer
            | CertificateError::BadSignature
            | CertificateError::BadEncoding,
        ) => format!(
            "the server's certificate is not trusted (sslmode={mode}): no root in {roots} \
             signed it; give sslrootcert=<PEM file of the certificate authority that signed \
             it>, or use sslmode=require to encrypt without verifying the server"
        ),
        rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => format!(
            "the server's certificate is not valid for host `{host}` (sslmode={mode}): {e}; \
             connect by a name the certificate holds, or use sslmode=verify-ca to check only \
             who signed it"
        ),
        other => format!(
            "the server's certificate is refused (sslmode={mode}): {other}; fix the server's \
             certificate, or use sslmode=require to encrypt without verifying the server"
        ),
    };
    rustls::Error::Other(rustls::OtherError(Arc::new(Refusal(message))))
}

/// A verification failure, worded for the user.
#[derive(Debug)]
struct Refusal(String);

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refusal {}

#[cfg(test)]
mod tests {
    use super::{SslMode, TlsSettings, split};
    use std::path::PathBuf;

    fn settings(mode: SslMode, root: Option<&str>) -> TlsSettings {
        TlsSettings { mode, root_cert: root.map(PathBuf::from) }
    }

    #[test]
    fn urls_lose_their_tls_parameters_and_keep_the_rest() {
        let cases = [
            ("postgres://u@h/db", "postgres://u@h/db", settings(SslMode::Prefer, None)),
            (
                "postgres://u@h/db?sslmode=disable",
                "postgres://u@h/db",
                settings(SslMode::Disable, None),
            ),
            (
                "postgresql://u@h/db?application_name=a&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&connect_timeout=3",
                "postgresql://u@h/db?application_name=a&connect_timeout=3",
                settings(SslMode::VerifyFull, Some("/etc/ca.pem")),
            ),
            (
                "host=h  sslmode = verify-ca user=u sslrootcert='/a b/c\\'a.pem' dbname=d",
                "host=h user=u dbname=d",
                settings(SslMode::VerifyCa, Some("/a b/c'a.pem")),
            ),
            ("host=h sslmode=require", "host=h", settings(SslMode::Require, None)),
        ];
        for (given, rest, want) in cases {
            let (got_rest, got) = split(given).expect(given);
            assert_eq!(got_rest, rest, "{given}");
            assert_eq!(got, want, "{given}");
        }
    }

    #[test]
    fn an_unknown_sslmode_is_refused_with_the_accepted_ones() {
        let e = split("postgres://u@h/db?sslmode=allow").expect_err("allow is not offered");
        assert!(e.message.contains("sslmode=allow is not supported; use disable, prefer"), "{e}");
    }
}
