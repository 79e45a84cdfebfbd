//! A real PostgreSQL server on loopback, from Debian's package (scripts/install-deps.sh installs
//! it), in its own temp dir, killed (with its backends) on drop: the shared response store that
//! router replicas use, started the way the harness starts etcd.
//!
//! PostgreSQL refuses to run as root, so under root it runs as the package's `postgres` user.
//! Durability is off (`fsync=off`): the tests check what replicas see, not what survives a power
//! cut.

use std::{
    fs::File,
    os::unix::{fs::chown, process::CommandExt},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use tempfile::TempDir;

use crate::{START_ATTEMPTS, free_port};

/// The database user the routers log in as, with a password (scram-sha-256, as in production).
pub const PG_USER: &str = "bellows";
const PG_PASSWORD: &str = "a test password";

pub struct Postgres {
    dir: TempDir,
    pub port: u16,
    child: Option<Child>,
    bin: PathBuf,
    /// The (uid, gid) it runs as, when this process is root.
    owner: Option<(u32, u32)>,
}

/// The newest installed server's binaries (`BELLOWS_PG_BIN` overrides).
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BELLOWS_PG_BIN") {
        return dir.into();
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin)| bin.join("postgres").exists())
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin).expect("PostgreSQL's server is installed (scripts/install-deps.sh installs it)")
}

/// The `postgres` user's ids, from /etc/passwd.
fn postgres_user() -> (u32, u32) {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let line =
        passwd.lines().find(|l| l.starts_with("postgres:")).expect("the postgresql package made a postgres user");
    let fields: Vec<&str> = line.split(':').collect();
    (fields[2].parse().unwrap(), fields[3].parse().unwrap())
}

impl Postgres {
    pub async fn start() -> Postgres {
        let dir = tempfile::Builder::new().prefix("bellows-pg").tempdir().unwrap();
        // SAFETY: geteuid has no preconditions.
        let owner = (unsafe { libc::geteuid() } == 0).then(postgres_user);
        if let Some((uid, gid)) = owner {
            chown(dir.path(), Some(uid), Some(gid)).unwrap();
        }
        let mut pg = Postgres { dir, port: free_port(), child: None, bin: bin_dir(), owner };
        pg.initdb();
        for _ in 1..START_ATTEMPTS {
            if pg.spawn().await {
                return pg;
            }
            pg.kill();
            pg.port = free_port();
        }
        assert!(pg.spawn().await, "postgres could not bind its port:\n{}", pg.log());
        pg
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.owner {
            c.uid(uid).gid(gid);
        }
        c
    }

    fn initdb(&self) {
        let pwfile = self.dir.path().join("initdb-password");
        std::fs::write(&pwfile, PG_PASSWORD).unwrap();
        if let Some((uid, gid)) = self.owner {
            chown(&pwfile, Some(uid), Some(gid)).unwrap();
        }
        let out = self
            .command("initdb")
            .arg("-D")
            .arg(self.data())
            .args(["-U", PG_USER, "--auth=scram-sha-256", "-E", "UTF8", "--no-sync"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .output()
            .expect("initdb runs");
        assert!(out.status.success(), "initdb failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    /// Spawn the server and wait until it takes logins; false if its port was taken.
    async fn spawn(&mut self) -> bool {
        let log = File::options().create(true).append(true).open(self.dir.path().join("postgres.log")).unwrap();
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string(), "-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", self.dir.path().display()))
            .args(["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("postgres runs");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.child.as_mut().is_some_and(|c| c.try_wait().unwrap().is_some()) {
                let log = self.log();
                assert!(log.contains("could not bind") || log.contains("already in use"), "postgres exited:\n{log}");
                return false;
            }
            if self.try_client().await.is_some() {
                return true;
            }
            assert!(Instant::now() < deadline, "postgres did not take logins within 30 s:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The URL a router is given (the password comes from [`Postgres::password_file`]).
    pub fn url(&self) -> String {
        format!("postgres://{PG_USER}@127.0.0.1:{}/postgres", self.port)
    }

    /// A file with the password, as a chart's secret would mount it.
    pub fn password_file(&self) -> PathBuf {
        let path = self.dir.path().join("password");
        if !path.exists() {
            std::fs::write(&path, format!("{PG_PASSWORD}\n")).unwrap();
        }
        path
    }

    /// The router flags that use this server as the response store.
    pub fn router_flags(&self) -> Vec<String> {
        let file = self.password_file();
        vec![
            "--responses-store-url".into(),
            self.url(),
            "--responses-store-password-file".into(),
            file.to_string_lossy().into_owned(),
        ]
    }

    async fn try_client(&self) -> Option<tokio_postgres::Client> {
        let config =
            format!("host=127.0.0.1 port={} user={PG_USER} password='{PG_PASSWORD}' dbname=postgres", self.port);
        let connect = tokio_postgres::connect(&config, tokio_postgres::NoTls);
        let (client, connection) = tokio::time::timeout(Duration::from_secs(2), connect).await.ok()?.ok()?;
        tokio::spawn(connection);
        Some(client)
    }

    /// A client logged in as the routers are, for a test to look at the tables.
    pub async fn client(&self) -> tokio_postgres::Client {
        self.try_client().await.expect("postgres takes logins")
    }

    /// Signal the server and every process it forked (its backends each run in a session of
    /// their own, so the postmaster's process group does not reach them). The postmaster goes
    /// first, so that it forks no one after the list is read.
    fn signal_all(&self, signal: i32) {
        let Some(c) = &self.child else { return };
        let postmaster = c.id() as i32;
        // SAFETY: kill has no memory preconditions; every pid signalled is this server's.
        unsafe { libc::kill(postmaster, signal) };
        for pid in children_of(postmaster) {
            // SAFETY: as above.
            unsafe { libc::kill(pid, signal) };
        }
    }

    /// SIGSTOP the server and its backends: connections stay open and nothing answers.
    pub fn freeze(&self) {
        self.signal_all(libc::SIGSTOP);
    }

    pub fn thaw(&self) {
        self.signal_all(libc::SIGCONT);
    }

    /// SIGKILL the server and its backends, as a crash would.
    pub fn kill(&mut self) {
        self.signal_all(libc::SIGCONT);
        self.signal_all(libc::SIGKILL);
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
        // A killed postmaster leaves its pid file: the next start would take it for a live one.
        let _ = std::fs::remove_file(self.data().join("postmaster.pid"));
    }

    /// Start again on the same data dir and port.
    pub async fn restart(&mut self) {
        self.kill();
        assert!(self.spawn().await, "postgres lost its port while down:\n{}", self.log());
    }
}

/// The processes whose parent is `parent`, from /proc.
fn children_of(parent: i32) -> Vec<i32> {
    let ppid = |pid: &str| -> Option<i32> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status.lines().find_map(|l| l.strip_prefix("PPid:"))?.trim().parse().ok()
    };
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|pid| ppid(&pid.to_string()) == Some(parent))
        .collect()
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.kill();
    }
}
