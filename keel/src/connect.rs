//! `Keel::connect`: the store a URL names, opened and migrated.

use crate::Error;
use crate::store::AnyStore;

/// Settings [`Keel::connect_with`](crate::Keel::connect_with) takes besides the URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    pub(crate) schema: String,
    pub(crate) pool_size: usize,
    pub(crate) migrate: bool,
    pub(crate) create: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions { schema: "keel".to_owned(), pool_size: 16, migrate: true, create: true }
    }
}

impl ConnectOptions {
    /// The PostgreSQL schema Keel's tables live in (default `keel`; lowercase letters,
    /// digits and `_`). Ignored by the other stores.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Most pooled PostgreSQL connections (default 16). Ignored by the other stores.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// Whether to bring a PostgreSQL schema up to date on connect (default `true`). With
    /// `false` the connect only checks that the schema is at this build's version, and
    /// refuses a missing or older one saying to run `keel migrate`. SQLite files are always
    /// migrated when opened.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Whether a `sqlite://` URL naming a file that does not exist creates it (default
    /// `true`). With `false` a missing file is an error that names the path, so a tool
    /// that only reads and operates (the `keel` command) never turns a mistyped path into
    /// a new, empty database. Ignored by the other stores.
    pub fn create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }
}

/// Which backend a URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    SqliteMemory,
    /// A SQLite file, and whether a missing one may be created (`mode=rw` says not).
    SqliteFile {
        path: String,
        create: bool,
    },
    Postgres(String),
    Memory,
}

/// Reads the URL's scheme; an unknown one is an error listing the ones Keel knows.
pub(crate) fn parse(url: &str) -> Result<Target, Error> {
    let url = url.trim();
    if let Some(rest) = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")) {
        return sqlite(url, rest);
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(Target::Postgres(url.to_owned()));
    }
    if url == "memory:" || url == "memory://" {
        return Ok(Target::Memory);
    }
    Err(Error::url(
        url,
        "unknown scheme; use `sqlite://<file>`, `sqlite::memory:`, `postgres://…` or `memory://`",
    ))
}

/// A SQLite URL after its scheme: the file (or `:memory:`) before `?`, then its options.
/// A file honours `mode=rwc` (create it when missing, the default) and `mode=rw` (open
/// only an existing file); the in-memory database honours `mode=memory`. Any other option
/// is refused, every one named, rather than dropped without a word.
fn sqlite(url: &str, rest: &str) -> Result<Target, Error> {
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let memory = path == ":memory:";
    let mut create = true;
    let mut refused = Vec::new();
    for option in query.split('&').filter(|o| !o.is_empty()) {
        match (option, memory) {
            ("mode=rwc", false) => create = true,
            ("mode=rw", false) => create = false,
            ("mode=memory", true) => {}
            _ => refused.push(format!("`{option}`")),
        }
    }
    if !refused.is_empty() {
        let fix = if memory {
            "the in-memory database takes no options: each connect to `sqlite::memory:` opens \
             one private database, which every clone of that `Keel` and every worker made \
             from it share; write `sqlite::memory:`"
        } else {
            "Keel opens the file to read and write and migrates it, and honours only \
             `mode=rwc` (create a missing file, the default) and `mode=rw` (open an existing \
             file only); remove the others (for a database in memory write `sqlite::memory:`)"
        };
        let options = refused.join(", ");
        return Err(Error::url(url, &format!("unsupported SQLite option {options}: {fix}")));
    }
    if memory {
        return Ok(Target::SqliteMemory);
    }
    if path.is_empty() {
        return Err(Error::url(url, "the SQLite URL names no file; write `sqlite://keel.db`"));
    }
    Ok(Target::SqliteFile { path: path.to_owned(), create })
}

/// The refusal of a missing SQLite file when [`ConnectOptions::create`] is off.
fn missing_file(path: &str) -> String {
    let place =
        std::env::current_dir().map(|dir| format!(" (in {})", dir.display())).unwrap_or_default();
    format!(
        "there is no SQLite file `{path}`{place}; name an existing file, or create the database first"
    )
}

/// Opens the store `url` names.
pub(crate) async fn open(url: &str, options: &ConnectOptions) -> Result<(AnyStore, String), Error> {
    match parse(url)? {
        Target::SqliteMemory => sqlite_memory(url).await,
        Target::SqliteFile { path, create } => {
            let may_create = options.create && create;
            if !may_create && !std::path::Path::new(&path).exists() {
                return Err(Error::url(url, &missing_file(&path)));
            }
            sqlite_file(url, &path).await
        }
        Target::Postgres(pg) => postgres(&pg, options).await,
        Target::Memory => memory(url),
    }
}

#[cfg(feature = "sqlite")]
async fn sqlite_memory(url: &str) -> Result<(AnyStore, String), Error> {
    let store =
        keel_store_sqlite::SqliteStore::memory().await.map_err(|e| Error::connect(url, e))?;
    Ok((AnyStore::new(store), "SQLite in memory".to_owned()))
}

#[cfg(feature = "sqlite")]
async fn sqlite_file(url: &str, path: &str) -> Result<(AnyStore, String), Error> {
    let store =
        keel_store_sqlite::SqliteStore::open(path).await.map_err(|e| Error::connect(url, e))?;
    Ok((AnyStore::new(store), format!("SQLite file {path}")))
}

#[cfg(not(feature = "sqlite"))]
async fn sqlite_memory(url: &str) -> Result<(AnyStore, String), Error> {
    Err(Error::feature(url, "sqlite"))
}

#[cfg(not(feature = "sqlite"))]
async fn sqlite_file(url: &str, _path: &str) -> Result<(AnyStore, String), Error> {
    Err(Error::feature(url, "sqlite"))
}

#[cfg(feature = "postgres")]
async fn postgres(url: &str, options: &ConnectOptions) -> Result<(AnyStore, String), Error> {
    use keel_store_postgres::{PgConfig, PgStore};
    let config = PgConfig::new(url).schema(options.schema.clone()).pool_size(options.pool_size);
    let store = PgStore::connect(config)
        .await
        .map_err(|e| Error::connect(keel_core::redact_url(url), e))?;
    // Without migrating, a schema that is missing or behind would fail at the first
    // query with a bare "relation does not exist"; it is refused here, saying what to run.
    let ready = if options.migrate { store.migrate().await } else { store.check_migrated().await };
    ready.map_err(|e| Error::connect(keel_core::redact_url(url), e))?;
    let described = format!("PostgreSQL {}, schema {}", keel_core::redact_url(url), options.schema);
    Ok((AnyStore::new(store), described))
}

#[cfg(not(feature = "postgres"))]
async fn postgres(url: &str, _options: &ConnectOptions) -> Result<(AnyStore, String), Error> {
    Err(Error::feature(&keel_core::redact_url(url), "postgres"))
}

#[cfg(feature = "testkit")]
#[allow(
    clippy::unnecessary_wraps,
    reason = "the same signature as without the feature, where it is an error"
)]
fn memory(_url: &str) -> Result<(AnyStore, String), Error> {
    Ok((AnyStore::new(keel_testkit::MemoryStore::new()), "in memory (testkit)".to_owned()))
}

#[cfg(not(feature = "testkit"))]
fn memory(url: &str) -> Result<(AnyStore, String), Error> {
    Err(Error::url(
        url,
        "the in-memory store comes with the `testkit` feature; enable it, or use `sqlite::memory:`",
    ))
}

#[cfg(test)]
mod tests {
    use super::{Target, parse};
    use keel_core::redact_url as redact;

    fn check(url: &str, expected: Result<Target, &str>) {
        match (parse(url), expected) {
            (Ok(got), Ok(want)) => assert_eq!(got, want, "{url}"),
            (Err(got), Err(want)) => assert!(got.to_string().contains(want), "{url}: {got}"),
            (got, want) => panic!("{url}: got {got:?}, expected {want:?}"),
        }
    }

    fn file(path: &str, create: bool) -> Target {
        Target::SqliteFile { path: path.into(), create }
    }

    #[test]
    fn urls_name_their_backend() {
        check("sqlite://keel.db", Ok(file("keel.db", true)));
        check("sqlite:data/keel.db?mode=rwc", Ok(file("data/keel.db", true)));
        check("sqlite:data/keel.db?mode=rw", Ok(file("data/keel.db", false)));
        check("sqlite::memory:", Ok(Target::SqliteMemory));
        check("sqlite://:memory:", Ok(Target::SqliteMemory));
        check("postgres://u@h/db", Ok(Target::Postgres("postgres://u@h/db".into())));
        check("postgresql://u@h/db", Ok(Target::Postgres("postgresql://u@h/db".into())));
        check("memory://", Ok(Target::Memory));
        check("sqlite://", Err("names no file"));
        check("mysql://u@h/db", Err("unknown scheme; use `sqlite://<file>`"));
    }

    #[test]
    fn sqlite_options_are_honoured_or_refused_by_name() {
        // `:memory:` with options is still the in-memory database, never a file of that name.
        check("sqlite::memory:?mode=memory", Ok(Target::SqliteMemory));
        check("sqlite://:memory:?mode=memory", Ok(Target::SqliteMemory));
        check(
            "sqlite::memory:?cache=shared",
            Err(
                "unsupported SQLite option `cache=shared`: the in-memory database takes no options",
            ),
        );
        check("sqlite://:memory:?cache=shared", Err("write `sqlite::memory:`"));
        // What Keel would not honour on a file is refused, every option named.
        check(
            "sqlite://keel.db?mode=ro&cache=shared&mode=rw",
            Err("unsupported SQLite option `mode=ro`, `cache=shared`: Keel opens the file"),
        );
        check("sqlite://keel.db?mode=memory", Err("honours only `mode=rwc`"));
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn mode_rw_opens_only_an_existing_file() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("keel.db");
        let rw = format!("sqlite://{}?mode=rw", path.display());
        let Err(e) = crate::Keel::connect(&rw).await else { panic!("mode=rw created a file") };
        assert!(e.to_string().contains("there is no SQLite file"), "{e}");
        assert!(!path.exists(), "nothing was created");
        drop(crate::Keel::connect(&format!("sqlite://{}?mode=rwc", path.display())).await.unwrap());
        let keel = crate::Keel::connect(&rw).await.expect("an existing file opens with mode=rw");
        assert_eq!(keel.describe(), format!("SQLite file {}", path.display()));
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn an_in_memory_url_with_options_is_one_database() {
        let keel = crate::Keel::connect("sqlite::memory:?mode=memory").await.expect("opens");
        assert_eq!(keel.describe(), "SQLite in memory");
        let start = crate::NewInstance::new(crate::MachineRef::new("m", 1), "q");
        let id = keel.start(start).await.expect("a start").id();
        assert_eq!(keel.get(id).await.expect("read back").instance.id, id);
    }

    #[test]
    fn postgres_tls_settings_are_left_to_the_store() {
        for mode in ["disable", "prefer", "require", "verify-ca", "verify-full"] {
            let url = format!("postgres://u@h/db?sslmode={mode}&sslrootcert=/etc/ca.pem");
            assert_eq!(parse(&url).expect("a PostgreSQL URL"), Target::Postgres(url.clone()));
        }
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn without_create_a_missing_sqlite_file_is_an_error_and_stays_missing() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("typo.db");
        let url = format!("sqlite://{}", path.display());
        let options = crate::ConnectOptions::default().create(false);
        let Err(e) = crate::Keel::connect_with(&url, options.clone()).await else {
            panic!("a missing file opened without create");
        };
        let message = e.to_string();
        assert!(message.contains("there is no SQLite file"), "{message}");
        assert!(message.contains(&path.display().to_string()), "names the path: {message}");
        assert!(!path.exists(), "nothing was created");
        // Once the file exists (made by an open that may create), the same options open it.
        drop(crate::Keel::connect(&url).await.expect("an open that creates"));
        crate::Keel::connect_with(&url, options).await.expect("an existing file opens");
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn a_refused_connection_says_why_and_says_it_once() {
        // Nothing listens on port 1 of the loopback.
        let Err(e) = crate::Keel::connect("postgres://keel:secret@127.0.0.1:1/keel").await else {
            panic!("nothing listens on port 1");
        };
        // What an error reporter prints: the message, then each source's.
        let mut chain = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            chain = format!("{chain}: {s}");
            source = s.source();
        }
        assert!(chain.contains("Connection refused"), "{chain}");
        assert_eq!(chain.matches("postgres pool").count(), 1, "{chain}");
        assert!(!chain.contains("secret"), "{chain}");
    }

    #[test]
    fn passwords_never_reach_messages() {
        // The rule itself is tested in keel-core; here, that connect's messages use it.
        assert_eq!(redact("postgres://u:secret@h:5432/db"), "postgres://u:***@h:5432/db");
        for url in [
            "postgres:/u:secret@db/x?sslrootcert=https://c",
            "postgres:/u:secret@db/x?o=a://b@c",
            "postgres://u:se/cret@h/db",
        ] {
            let shown = redact(url);
            assert!(!shown.contains("secret") && !shown.contains("ecret"), "{url} -> {shown}");
        }
    }
}
