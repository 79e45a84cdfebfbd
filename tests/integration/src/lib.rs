//! Harness for whole-cluster tests: a real etcd, real `bellows-worker` and `bellows-router`
//! processes on free loopback ports, each in its own temp dir and killed on drop. Nothing is
//! mocked: tests speak HTTP and gRPC to the binaries that ship.
//!
//! The binaries are found next to the test executable's directory (`target/<profile>/`), or in
//! `BELLOWS_BIN_DIR`; `scripts/test.sh` builds them before the tests run.

pub mod pki;
pub mod postgres;
pub mod schemas;

use std::{
    fs::File,
    path::PathBuf,
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use bellows_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use tempfile::TempDir;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

/// Processes that find their port taken (see `Process::lost_its_port`) are started this many
/// times, each on a fresh port.
const START_ATTEMPTS: usize = 3;

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A gauge or counter from the metrics page at `url` (the sum over its label sets).
pub async fn metric_at(url: &str, name: &str) -> f64 {
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.split([' ', '{']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Poll `f` until it returns `Some`, or fail with `what` after `limit`.
pub async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A Bellows binary built by cargo in the same profile as the running test.
pub fn binary(name: &str) -> PathBuf {
    let dir = match std::env::var_os("BELLOWS_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let exe = std::env::current_exe().expect("the test knows its path");
            // target/<profile>/deps/<test> -> target/<profile>
            exe.parent().and_then(|p| p.parent()).expect("test binaries live in target/<profile>/deps").to_path_buf()
        }
    };
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build it first (cargo build --release --workspace --bins, as scripts/test.sh does)",
        path.display()
    );
    path
}

/// One etcd member on loopback with its own data dir.
pub struct Etcd {
    dir: TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    tls: Option<EtcdTls>,
    auth: Option<EtcdAuth>,
}

/// The etcd user [`Etcd::start_auth`] creates: its role may read and write `/bellows/` only.
pub const ETCD_USER: &str = "bellows";
const ETCD_PASSWORD: &str = "bellows-secret";
const ETCD_ROOT_PASSWORD: &str = "root-secret";

/// etcd's own password auth, as [`Etcd::start_auth`] sets it up.
pub struct EtcdAuth {
    /// [`ETCD_USER`]'s password, in a file as the processes take it.
    pub password_file: PathBuf,
    /// A password etcd refuses for [`ETCD_USER`].
    pub wrong_password_file: PathBuf,
    /// etcd's `--auth-token-ttl`: a simple token dies this long after the request that last used it.
    pub token_ttl: Duration,
    /// Set once `auth enable` is done: the test's own calls log in as root from then on.
    enabled: bool,
}

/// An etcd that serves TLS and requires client certificates.
pub struct EtcdTls {
    pub ca: PathBuf,
    server: pki::Issued,
    /// The certificate the test's own calls present (and processes may be given).
    pub client: pki::Issued,
}

impl EtcdTls {
    /// Flags for a router or worker: etcd's CA and a client certificate.
    pub fn flags(&self) -> Vec<String> {
        let path = |p: &PathBuf| p.to_string_lossy().into_owned();
        vec![
            "--etcd-ca".into(),
            path(&self.ca),
            "--etcd-cert".into(),
            path(&self.client.cert),
            "--etcd-key".into(),
            path(&self.client.key),
        ]
    }

    fn options(&self) -> etcd_client::ConnectOptions {
        let read = |p: &PathBuf| std::fs::read(p).unwrap();
        let tls = etcd_client::TlsOptions::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(read(&self.ca)))
            .identity(tonic::transport::Identity::from_pem(read(&self.client.cert), read(&self.client.key)));
        etcd_client::ConnectOptions::new().with_tls(tls)
    }
}

impl Etcd {
    /// Start a member on fresh ports; one that lost a port to another test (see
    /// `Process::lost_its_port`) is started again on others.
    pub async fn start() -> Etcd {
        Etcd::start_with(None, None).await
    }

    /// A member serving TLS with a certificate from `pki`, refusing clients without one.
    pub async fn start_tls(pki: &pki::Pki) -> Etcd {
        let tls = EtcdTls {
            ca: pki.ca_path(),
            server: pki.issue("etcd-server", &["127.0.0.1", "localhost"]),
            client: pki.issue("etcd-client", &["etcd-client"]),
        };
        Etcd::start_with(Some(tls), None).await
    }

    /// A member with password auth enabled: user root, and [`ETCD_USER`] with a role that may
    /// read and write `/bellows/` only. Simple tokens die `token_ttl` (whole seconds) after
    /// their last use. The test's own calls ([`Etcd::client`]) log in as root.
    pub async fn start_auth(token_ttl: Duration) -> Etcd {
        let dir = TempDir::new().unwrap();
        let (password_file, wrong_password_file) = (dir.path().join("password"), dir.path().join("wrong-password"));
        std::fs::write(&password_file, format!("{ETCD_PASSWORD}\n")).unwrap();
        std::fs::write(&wrong_password_file, "not-the-password\n").unwrap();
        let auth = EtcdAuth { password_file, wrong_password_file, token_ttl, enabled: false };
        let mut e = Etcd::start_in(dir, None, Some(auth)).await;
        let mut c = e.client().await;
        c.role_add("root").await.unwrap();
        c.user_add("root", ETCD_ROOT_PASSWORD, None).await.unwrap();
        c.user_grant_role("root", "root").await.unwrap();
        c.role_add("bellows").await.unwrap();
        c.role_grant_permission("bellows", etcd_client::Permission::read_write("/bellows/").with_prefix())
            .await
            .unwrap();
        c.user_add(ETCD_USER, ETCD_PASSWORD, None).await.unwrap();
        c.user_grant_role(ETCD_USER, "bellows").await.unwrap();
        c.auth_enable().await.unwrap();
        e.auth.as_mut().expect("set above").enabled = true;
        e
    }

    pub fn auth(&self) -> Option<&EtcdAuth> {
        self.auth.as_ref()
    }

    /// Flags for a router or worker logging in as [`ETCD_USER`] with the right password, or with
    /// a wrong one.
    pub fn auth_flags(&self, right_password: bool) -> Vec<String> {
        let auth = self.auth.as_ref().expect("an etcd started with start_auth");
        let file = if right_password { &auth.password_file } else { &auth.wrong_password_file };
        vec!["--etcd-user".into(), ETCD_USER.into(), "--etcd-password-file".into(), file.to_string_lossy().into_owned()]
    }

    /// Wait until etcd has dropped every token that no request has used since this call began:
    /// those of the routers and workers that only streamed since (etcd checks no token on a
    /// watch or a keep-alive stream).
    ///
    /// A token's life is wall time, and etcd says nothing when it drops one, so what is waited
    /// for is etcd's answer: tokens minted at the start, each used once to ask, oldest first,
    /// until etcd calls one invalid. Asking renews the token asked with (etcd restarts a token's
    /// TTL at each use), hence a fresh one each time; a refused token was minted after every
    /// token in question was last used, so those are gone too.
    pub async fn wait_tokens_expired(&self) {
        let auth = self.auth.as_ref().filter(|a| a.enabled).expect("an etcd with auth enabled");
        const ASK_EVERY: Duration = Duration::from_millis(250);
        // etcd looks for dead tokens once a second: a few seconds past the TTL at most.
        let asks = ((auth.token_ttl + Duration::from_secs(5)).as_millis() / ASK_EVERY.as_millis()) as usize;
        let login = etcd_client::ConnectOptions::new().with_user(ETCD_USER, ETCD_PASSWORD);
        let mut probes = Vec::with_capacity(asks);
        for _ in 0..asks {
            // Each client logs in once (a token of its own) and is not used until asked.
            probes.push(etcd_client::Client::connect([self.endpoint()], Some(login.clone())).await.unwrap());
        }
        for mut probe in probes {
            tokio::time::sleep(ASK_EVERY).await;
            match probe.get("/bellows/token-probe", None).await {
                Ok(_) => continue,
                Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("invalid auth token") => return,
                Err(e) => panic!("etcd failed a token probe: {e}"),
            }
        }
        panic!("etcd kept tokens alive more than {:?} past their TTL", auth.token_ttl + Duration::from_secs(5));
    }

    pub fn tls(&self) -> Option<&EtcdTls> {
        self.tls.as_ref()
    }

    async fn start_with(tls: Option<EtcdTls>, auth: Option<EtcdAuth>) -> Etcd {
        Etcd::start_in(TempDir::new().unwrap(), tls, auth).await
    }

    async fn start_in(dir: TempDir, tls: Option<EtcdTls>, auth: Option<EtcdAuth>) -> Etcd {
        let mut e = Etcd { dir, client_port: free_port(), peer_port: free_port(), child: None, tls, auth };
        for _ in 1..START_ATTEMPTS {
            if e.spawn().await {
                return e;
            }
            e.kill();
            (e.client_port, e.peer_port) = (free_port(), free_port());
        }
        assert!(e.spawn().await, "etcd could not bind its ports:\n{}", e.log());
        e
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }

    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    fn options(&self) -> Option<etcd_client::ConnectOptions> {
        let options = self.tls.as_ref().map(EtcdTls::options);
        match &self.auth {
            Some(auth) if auth.enabled => Some(options.unwrap_or_default().with_user("root", ETCD_ROOT_PASSWORD)),
            _ => options,
        }
    }

    /// Spawn etcd and wait until it serves; false if it exited because a port was taken.
    async fn spawn(&mut self) -> bool {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = File::options().create(true).append(true).open(self.dir.path().join("etcd.log")).unwrap();
        let mut command = Command::new("etcd");
        if let Some(tls) = &self.tls {
            command.arg("--cert-file").arg(&tls.server.cert).arg("--key-file").arg(&tls.server.key);
            command.arg("--client-cert-auth").arg("--trusted-ca-file").arg(&tls.ca);
        }
        if let Some(auth) = &self.auth {
            let ttl = auth.token_ttl.as_secs_f64().ceil().max(1.0).to_string();
            // The lowest bcrypt cost: each login hashes the password, and tests log in often.
            command.args(["--auth-token", "simple", "--auth-token-ttl", &ttl, "--bcrypt-cost", "4"]);
        }
        let child = command
            .args(["--name", "test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &self.endpoint(), "--advertise-client-urls", &self.endpoint()])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("etcd runs (scripts/install-deps.sh installs it)");
        self.child = Some(child);
        let endpoint = self.endpoint();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.child.as_mut().is_some_and(|c| c.try_wait().unwrap().is_some()) {
                let log = self.log();
                assert!(log.contains("address already in use"), "etcd exited:\n{log}");
                return false;
            }
            if let Ok(mut c) = etcd_client::Client::connect([endpoint.as_str()], self.options()).await
                && let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(1), c.get("probe", None)).await
            {
                return true;
            }
            assert!(Instant::now() < deadline, "etcd did not serve within 20 s:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], self.options()).await.unwrap()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start again on the same data dir and ports.
    pub async fn restart(&mut self) {
        self.kill();
        assert!(self.spawn().await, "etcd lost its ports while down:\n{}", self.log());
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A child process with its log in a temp dir; killed on drop, its log printed if the test
/// failed.
pub struct Process {
    child: Child,
    pub addr: String,
    name: &'static str,
    log: PathBuf,
    _dir: TempDir,
}

impl Process {
    /// Start `bin` with `args`; `addr` names what it serves, for messages.
    pub fn spawn(name: &'static str, bin: PathBuf, args: Vec<String>, addr: String, env: &[(&str, &str)]) -> Process {
        let dir = TempDir::new().unwrap();
        let log = dir.path().join(format!("{name}.log"));
        let file = File::create(&log).unwrap();
        let child = Command::new(&bin)
            .args(args)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("{} starts: {e}", bin.display()));
        Process { child, addr, name, log, _dir: dir }
    }

    /// Whether the process has exited (it never should before a test stops it).
    pub fn exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// It exited because another test bound its port first: the port came from [`free_port`],
    /// which can only say the port was free a moment ago.
    fn lost_its_port(&mut self) -> bool {
        self.exited() && self.log().contains("Address already in use")
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// What the process has logged so far (for failure messages, and to wait for a logged state).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({sig}) failed");
    }

    /// SIGKILL, as a crash would, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Wait for the process to exit (polling, up to `limit`).
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "{} still running after {limit:?}; log:\n{}", self.name, self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("---- {} {} log ----\n{}", self.name, self.addr, self.log());
        }
    }
}

/// Arguments for a worker on the simulated engine with these sim settings (JSON object fields).
pub fn sim(config: &str) -> Vec<String> {
    vec!["--engine".into(), "sim".into(), "--sim-config".into(), config.into()]
}

/// A `bellows-worker serve` process, and how to reach it (TLS settings when it serves TLS).
pub struct Worker(pub Process, Option<ClientTlsConfig>);

impl std::ops::Deref for Worker {
    type Target = Process;
    fn deref(&self) -> &Process {
        &self.0
    }
}

impl std::ops::DerefMut for Worker {
    fn deref_mut(&mut self) -> &mut Process {
        &mut self.0
    }
}

impl Worker {
    /// Start a worker from `bin` on a free loopback port, and wait until it is SERVING.
    pub async fn start_bin<S: AsRef<str>>(bin: PathBuf, args: &[S]) -> Worker {
        Worker::start_with(bin, args, &[], None, None).await
    }

    /// Start a worker (the workspace's `bellows-worker`) and wait until it is SERVING.
    pub async fn start<S: AsRef<str>>(args: &[S]) -> Worker {
        Worker::start_bin(binary("bellows-worker"), args).await
    }

    pub fn spawn_bin<S: AsRef<str>>(bin: PathBuf, args: &[S]) -> Worker {
        Worker::spawn_env(bin, args, &[])
    }

    /// Start a worker with extra environment variables, and wait until it is SERVING.
    pub async fn start_env<S: AsRef<str>>(args: &[S], env: &[(&str, &str)]) -> Worker {
        Worker::start_with(binary("bellows-worker"), args, env, None, None).await
    }

    async fn start_with<S: AsRef<str>>(
        bin: PathBuf,
        args: &[S],
        env: &[(&str, &str)],
        tls: Option<ClientTlsConfig>,
        advertise_host: Option<&str>,
    ) -> Worker {
        for attempt in 1..=START_ATTEMPTS {
            let mut w = Worker::spawn_as(bin.clone(), args, env, advertise_host);
            w.1 = tls.clone();
            if w.serving_or_lost_port().await {
                return w;
            }
            assert!(attempt < START_ATTEMPTS, "worker lost its port {START_ATTEMPTS} times; log:\n{}", w.log());
        }
        unreachable!("the last attempt returns or fails")
    }

    fn spawn_env<S: AsRef<str>>(bin: PathBuf, args: &[S], env: &[(&str, &str)]) -> Worker {
        Worker::spawn_as(bin, args, env, None)
    }

    /// Spawn on a free loopback port, registering its address under `advertise_host` if given.
    fn spawn_as<S: AsRef<str>>(bin: PathBuf, args: &[S], env: &[(&str, &str)], advertise_host: Option<&str>) -> Worker {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let mut all = vec!["serve".to_string(), "--listen".into(), addr.clone()];
        if let Some(host) = advertise_host {
            all.extend(["--advertise-address".into(), format!("{host}:{port}")]);
        }
        all.extend(args.iter().map(|a| a.as_ref().to_string()));
        Worker(Process::spawn("worker", bin, all, addr, env), None)
    }

    /// Start a worker that serves TLS; the test's own calls to it (health, load) use `tls`.
    pub async fn start_tls<S: AsRef<str>>(args: &[S], tls: ClientTlsConfig) -> Worker {
        Worker::start_with(binary("bellows-worker"), args, &[], Some(tls), None).await
    }

    /// [`Worker::start_tls`], registering its address as `host:<port>`.
    pub async fn start_tls_advertising<S: AsRef<str>>(args: &[S], tls: ClientTlsConfig, host: &str) -> Worker {
        Worker::start_with(binary("bellows-worker"), args, &[], Some(tls), Some(host)).await
    }

    /// A channel to the worker, over TLS when it serves TLS.
    async fn channel(&self) -> Result<Channel, tonic::transport::Error> {
        match &self.1 {
            None => Endpoint::from_shared(format!("http://{}", self.addr))?.connect().await,
            Some(tls) => {
                Endpoint::from_shared(format!("https://{}", self.addr))?.tls_config(tls.clone())?.connect().await
            }
        }
    }

    /// Wait until the worker is SERVING; fail at once if it exits.
    pub async fn wait_serving(&mut self) {
        assert!(self.serving_or_lost_port().await, "worker lost its port; log:\n{}", self.log());
    }

    /// `true` once SERVING, `false` if it exited because its port was taken; any other exit fails.
    async fn serving_or_lost_port(&mut self) -> bool {
        let limit = Duration::from_secs(180); // a real model loads in seconds; a busy machine is slower
        let deadline = Instant::now() + limit;
        while self.health().await != Some(ServingStatus::Serving) {
            if self.0.lost_its_port() {
                return false;
            }
            assert!(!self.0.exited(), "worker exited before SERVING; log:\n{}", self.log());
            assert!(Instant::now() < deadline, "worker not SERVING after {limit:?}; log:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }

    /// The whole server's health ("" service); `None` if the worker does not answer.
    pub async fn health(&self) -> Option<ServingStatus> {
        let channel = self.channel().await.ok()?;
        let r = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await.ok()?;
        ServingStatus::try_from(r.into_inner().status).ok()
    }

    pub async fn client(&self) -> WorkerClient<Channel> {
        WorkerClient::new(self.channel().await.expect("connects to the worker"))
    }

    /// The worker's current load, from the first message of a WatchLoad stream.
    pub async fn load(&self) -> pb::LoadReport {
        let mut stream = self.client().await.watch_load(pb::WatchLoadRequest {}).await.unwrap().into_inner();
        stream.message().await.unwrap().and_then(|m| m.load).expect("the first message carries the load")
    }
}

/// A `bellows-router` process.
pub struct Router {
    pub process: Process,
    pub url: String,
}

impl Router {
    /// Start a router on a free port with these arguments, and wait until it answers /health.
    pub async fn start<S: AsRef<str>>(args: &[S]) -> Router {
        Router::start_env(args, &[]).await
    }

    /// Start a router with extra environment variables.
    pub async fn start_env<S: AsRef<str>>(args: &[S], env: &[(&str, &str)]) -> Router {
        let http = reqwest::Client::new();
        for attempt in 1..=START_ATTEMPTS {
            let addr = format!("127.0.0.1:{}", free_port());
            let mut all = vec!["--listen".to_string(), addr.clone()];
            all.extend(args.iter().map(|a| a.as_ref().to_string()));
            let process = Process::spawn("router", binary("bellows-router"), all, addr.clone(), env);
            let mut router = Router { process, url: format!("http://{addr}") };
            let health = format!("{}/health", router.url);
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if http.get(&health).send().await.is_ok_and(|r| r.status().is_success()) {
                    return router;
                }
                if router.process.lost_its_port() && attempt < START_ATTEMPTS {
                    break;
                }
                assert!(
                    !router.process.exited(),
                    "router exited before answering /health; log:\n{}",
                    router.process.log()
                );
                assert!(
                    Instant::now() < deadline,
                    "the router did not answer /health within 30 s; log:\n{}",
                    router.process.log()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        unreachable!("the last attempt returns or fails")
    }

    /// Start a router in front of these workers (static list).
    pub async fn with_workers<S: AsRef<str>>(workers: &[&Worker], extra: &[S]) -> Router {
        let list: Vec<&str> = workers.iter().map(|w| w.addr.as_str()).collect();
        let mut args = vec!["--workers".to_string(), list.join(",")];
        args.extend(extra.iter().map(|a| a.as_ref().to_string()));
        let router = Router::start(&args).await;
        router.wait_placeable(workers.len()).await;
        router
    }

    /// A gauge or counter from `/metrics` (the sum over its label sets).
    pub async fn metric(&self, name: &str) -> f64 {
        metric_at(&self.url("/metrics"), name).await
    }

    /// Wait until exactly `n` workers can take work.
    pub async fn wait_placeable(&self, n: usize) {
        let what = format!("{n} placeable workers");
        eventually(&what, Duration::from_secs(60), || async {
            (self.metric("bellows_router_placeable_workers").await == n as f64).then_some(())
        })
        .await;
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// POST a JSON body; the status and the parsed body (JSON, or the raw text as a string).
    pub async fn post(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
        let r = reqwest::Client::new().post(self.url(path)).json(body).send().await.expect("the router answers");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap();
        let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        (status, headers, json)
    }

    /// Each choice's text and finish reason, from a whole or a streamed (`"stream": true`) answer
    /// of either endpoint; panics on a status other than 200.
    pub async fn choices(&self, path: &str, body: &serde_json::Value) -> Vec<(String, String)> {
        let text = |c: &serde_json::Value, key: &str| {
            c[key]["content"].as_str().or(c["text"].as_str()).unwrap_or("").to_string()
        };
        if body["stream"] != true {
            let (status, _, reply) = self.post(path, body).await;
            assert_eq!(status, 200, "{reply}");
            return reply["choices"]
                .as_array()
                .expect("choices")
                .iter()
                .map(|c| (text(c, "message"), c["finish_reason"].as_str().unwrap_or("").to_string()))
                .collect();
        }
        let response = reqwest::Client::new().post(self.url(path)).json(body).send().await.expect("the router answers");
        assert_eq!(response.status(), 200);
        let n = body["n"].as_u64().unwrap_or(1) as usize;
        let mut out = vec![(String::new(), String::new()); n];
        for chunk in sse(response).await.iter().filter(|e| e.is_object()) {
            for c in chunk["choices"].as_array().expect("choices") {
                let i = c["index"].as_u64().expect("index") as usize;
                out[i].0 += &text(c, "delta");
                if let Some(f) = c["finish_reason"].as_str() {
                    out[i].1 = f.to_string();
                }
            }
        }
        out
    }

    pub async fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let r = reqwest::get(self.url(path)).await.expect("the router answers");
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)))
    }
}

/// An official client's Python package: the variable that may name its directory, and its
/// directory under `~/.cache/bellows` (where scripts/install-deps.sh puts it).
pub type ClientPackage = (&'static str, &'static str);
pub const OPENAI: ClientPackage = ("BELLOWS_PY_OPENAI", "py-openai");
pub const ANTHROPIC: ClientPackage = ("BELLOWS_PY_ANTHROPIC", "py-anthropic");

impl Router {
    /// Run one of the official-client scripts in `tests/` against this router for `model`, with
    /// the clients' `packages` importable. Fails the test with the script's output if it fails.
    pub fn run_official_client(&self, script: &str, model: &str, packages: &[ClientPackage]) {
        let home = std::env::var("HOME").unwrap();
        let paths: Vec<String> = packages
            .iter()
            .map(|(env, dir)| std::env::var(env).unwrap_or_else(|_| format!("{home}/.cache/bellows/{dir}")))
            .collect();
        // Read when the test runs: a binary built in another checkout sharing the target
        // directory must not run that checkout's script.
        let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("tests").join(script);
        let out = Command::new("python3")
            .arg(&path)
            .env("PYTHONPATH", paths.join(":"))
            .env("BASE_URL", &self.url)
            .env("MODEL", model)
            .output()
            .expect("python3 runs (scripts/install-deps.sh installs the official clients)");
        assert!(
            out.status.success(),
            "{script} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// One parsed SSE stream: the `data:` payloads in order (`[DONE]` included as a string).
pub async fn sse(response: reqwest::Response) -> Vec<serde_json::Value> {
    sse_named(response).await.into_iter().map(|(_, data)| data).collect()
}

/// One parsed SSE stream: each event's name (its `event:` line, empty without one) and its
/// `data:` payload, in order.
pub async fn sse_named(response: reqwest::Response) -> Vec<(String, serde_json::Value)> {
    use futures_util::StreamExt;
    let mut body = response.bytes_stream();
    let mut buf = String::new();
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        buf.push_str(std::str::from_utf8(&chunk.expect("the stream reads")).expect("SSE is UTF-8"));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let mut name = String::new();
            for line in event.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(data) = line.strip_prefix("data: ") {
                    let data = serde_json::from_str(data).unwrap_or(serde_json::Value::String(data.to_string()));
                    out.push((name.clone(), data));
                }
            }
        }
    }
    out
}
