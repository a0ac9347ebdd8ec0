//! TLS against the test server, which offers it with a self-signed certificate (Debian's
//! "snakeoil" one): each `sslmode` connects, encrypts and verifies as libpq's does, and a
//! verification that cannot succeed fails with a message that says why and what to do.

mod common;

use keel_store_postgres::{PgConfig, PgStore};
use std::time::Duration;

/// Debian's self-signed certificate, which the test server presents.
const SNAKEOIL: &str = "/etc/ssl/certs/ssl-cert-snakeoil.pem";

/// The test URL with `params` added to its query.
fn with(url: &str, params: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{params}")
}

/// Connects with a small pool, giving up after a while rather than hanging a test.
async fn connect(url: &str) -> Result<PgStore, keel_core::StoreError> {
    let config = PgConfig::new(url).schema(common::fresh_schema()).pool_size(1);
    tokio::time::timeout(Duration::from_secs(20), PgStore::connect(config))
        .await
        .expect("the connect finishes")
}

/// The test URL when the server offers TLS (`ssl = on`); else `None`, saying loudly that
/// the test is skipped (a server without TLS is a setting of the server, not a missing
/// backend).
async fn tls_server() -> Option<String> {
    let url = common::database_url()?;
    let store = connect(&with(&url, "sslmode=disable")).await.expect("a plain connection");
    let client = store.client().await.expect("a pooled connection");
    let ssl: String = client.query_one("SHOW ssl", &[]).await.expect("SHOW ssl").get(0);
    if ssl != "on" {
        keel_testkit::conformance::skip_notice("SKIPPED: the test server has ssl = off");
        return None;
    }
    Some(url)
}

/// Whether the store's session is encrypted, as the server sees it.
async fn encrypted(store: &PgStore) -> bool {
    let client = store.client().await.expect("a pooled connection");
    let row = client
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[])
        .await
        .expect("pg_stat_ssl");
    row.get(0)
}

#[tokio::test]
async fn require_encrypts_without_verifying() {
    let Some(url) = tls_server().await else { return };
    let store = connect(&with(&url, "sslmode=require")).await.expect("sslmode=require connects");
    assert!(encrypted(&store).await, "sslmode=require gives an encrypted session");
    // The other connections go through the same connector.
    let mut listener = store.listen().await.expect("a listening connection over TLS");
    assert!(listener.try_recv().is_none());
    store.migrate().await.expect("a migration over TLS");
}

#[tokio::test]
async fn disable_stays_plain() {
    let Some(url) = common::database_url() else { return };
    let store = connect(&with(&url, "sslmode=disable")).await.expect("sslmode=disable connects");
    assert!(!encrypted(&store).await, "sslmode=disable gives a plain session");
}

#[tokio::test]
async fn the_default_prefers_tls_and_does_not_verify() {
    let Some(url) = tls_server().await else { return };
    let store = connect(&url).await.expect("a URL without sslmode connects");
    // The test server offers TLS, so the default takes it, self-signed certificate and all.
    assert!(encrypted(&store).await, "the default (prefer) encrypts when the server offers it");
    let store = connect(&with(&url, "sslmode=prefer")).await.expect("sslmode=prefer connects");
    assert!(encrypted(&store).await);
}

/// A certificate authority that signed nothing the test server shows.
const UNRELATED_CA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/unrelated-ca.pem");

#[tokio::test]
async fn verify_full_refuses_a_certificate_no_root_signed() {
    let Some(url) = tls_server().await else { return };
    let params = format!("sslmode=verify-full&sslrootcert={UNRELATED_CA}");
    let Err(e) = connect(&with(&url, &params)).await else {
        panic!("a certificate that no given root signed passed verify-full");
    };
    let message = e.to_string();
    assert!(
        message.contains("the server's certificate is not trusted (sslmode=verify-full)"),
        "{e}"
    );
    assert!(message.contains(&format!("no root in sslrootcert={UNRELATED_CA} signed it")), "{e}");
    assert!(message.contains("give sslrootcert=<PEM file"), "{e}");
    assert!(message.contains("or use sslmode=require"), "{e}");

    // Against the system's roots it fails too: Debian lists its self-signed certificate
    // among them, so what fails there may be the host name rather than the chain.
    let Err(e) = connect(&with(&url, "sslmode=verify-full")).await else {
        panic!("a self-signed certificate passed verify-full against the system's roots");
    };
    let message = e.to_string();
    assert!(message.contains("(sslmode=verify-full)"), "{e}");
    assert!(
        message.contains("or use sslmode=require") || message.contains("use sslmode=verify-ca"),
        "{e}"
    );
}

#[tokio::test]
async fn a_bad_sslrootcert_is_named() {
    let Some(url) = common::database_url() else { return };
    let missing = "/nonexistent/keel-root.pem";
    let Err(e) = connect(&with(&url, &format!("sslmode=verify-ca&sslrootcert={missing}"))).await
    else {
        panic!("a missing root file was accepted");
    };
    let message = e.to_string();
    assert!(message.contains(&format!("sslrootcert={missing}: cannot read it")), "{e}");
    assert!(message.contains("name a PEM file"), "{e}");

    let dir = std::env::temp_dir().join(format!("keel-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let not_pem = dir.join("not-pem.txt");
    std::fs::write(&not_pem, "this is not a certificate\n").expect("write");
    let Err(e) =
        connect(&with(&url, &format!("sslmode=verify-ca&sslrootcert={}", not_pem.display()))).await
    else {
        panic!("a file that is not PEM was accepted");
    };
    let message = e.to_string();
    assert!(
        message.contains(&format!("sslrootcert={}: holds no PEM certificate", not_pem.display())),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The server's own certificate, given as the root, passes `verify-ca`; and `verify-full`
/// to an address the certificate does not name fails, saying so.
#[tokio::test]
async fn verify_ca_trusts_the_given_root() {
    let Some(url) = tls_server().await else { return };
    if std::fs::read(SNAKEOIL).is_err() {
        keel_testkit::conformance::skip_notice(&format!("SKIPPED: {SNAKEOIL} is not readable"));
        return;
    }
    let store = connect(&with(&url, &format!("sslmode=verify-ca&sslrootcert={SNAKEOIL}")))
        .await
        .expect("verify-ca with the server's certificate as the root");
    assert!(encrypted(&store).await);

    // Debian's certificate names the machine's host name, never an IP address.
    if url.contains("@127.0.0.1") {
        let Err(e) =
            connect(&with(&url, &format!("sslmode=verify-full&sslrootcert={SNAKEOIL}"))).await
        else {
            panic!("verify-full accepted a certificate that does not name 127.0.0.1");
        };
        let message = e.to_string();
        assert!(message.contains("not valid for host `127.0.0.1` (sslmode=verify-full)"), "{e}");
        assert!(message.contains("use sslmode=verify-ca"), "{e}");
    }
}
