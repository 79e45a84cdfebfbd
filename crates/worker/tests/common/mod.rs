//! Harness for the node tests: a real etcd and real `bellows-worker serve` processes on free
//! loopback ports, each in its own temp dir and killed on drop. Nothing is mocked: the tests talk
//! gRPC to the binary that ships, and read etcd with a real client.
#![allow(dead_code)] // each test file uses part of the harness

use std::{
    fs::File,
    path::PathBuf,
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use bellows_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use tempfile::TempDir;
use tonic::{Status, transport::Channel};
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
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

/// One etcd member on loopback with its own data dir.
pub struct Etcd {
    dir: TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl Etcd {
    pub async fn start() -> Etcd {
        let mut e =
            Etcd { dir: TempDir::new().unwrap(), client_port: free_port(), peer_port: free_port(), child: None };
        e.spawn().await;
        e
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    async fn spawn(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = File::options().create(true).append(true).open(self.dir.path().join("etcd.log")).unwrap();
        let child = Command::new("etcd")
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
        eventually("etcd to serve", Duration::from_secs(20), || async {
            let mut c = etcd_client::Client::connect([endpoint.as_str()], None).await.ok()?;
            tokio::time::timeout(Duration::from_secs(1), c.get("probe", None)).await.ok()?.ok()
        })
        .await;
    }

    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], None).await.unwrap()
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
        self.spawn().await;
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Arguments for a node on the simulated engine with these sim settings (JSON object fields).
pub fn sim(config: &str) -> Vec<String> {
    vec!["--engine".into(), "sim".into(), "--sim-config".into(), config.into()]
}

/// A `bellows-worker serve` process.
pub struct Node {
    child: Child,
    pub addr: String,
    log: PathBuf,
    _dir: TempDir,
}

impl Node {
    /// Start a node on a free loopback port and wait until its health says SERVING.
    pub async fn start<S: AsRef<str>>(args: &[S]) -> Node {
        let node = Node::spawn(args);
        node.wait_serving().await;
        node
    }

    pub fn spawn<S: AsRef<str>>(args: &[S]) -> Node {
        let dir = TempDir::new().unwrap();
        let log = dir.path().join("node.log");
        let addr = format!("127.0.0.1:{}", free_port());
        let file = File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_bellows-worker"))
            .args(["serve", "--listen", &addr])
            .args(args.iter().map(|a| a.as_ref()))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("the bellows-worker binary starts");
        Node { child, addr, log, _dir: dir }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// What the node has logged so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn wait_serving(&self) {
        let limit = Duration::from_secs(180); // a real model loads in seconds; a busy machine is slower
        let deadline = Instant::now() + limit;
        while self.health().await != Some(ServingStatus::Serving) {
            assert!(Instant::now() < deadline, "node not SERVING after {limit:?}; log:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The whole server's health ("" service); `None` if the node does not answer.
    pub async fn health(&self) -> Option<ServingStatus> {
        let channel = Channel::from_shared(format!("http://{}", self.addr)).unwrap().connect().await.ok()?;
        let r = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await.ok()?;
        ServingStatus::try_from(r.into_inner().status).ok()
    }

    pub async fn client(&self) -> WorkerClient<Channel> {
        WorkerClient::connect(format!("http://{}", self.addr)).await.expect("connects to the node")
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({sig}) failed");
    }

    /// Wait for the process to exit (polling, up to `limit`).
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "node still running after {limit:?}; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- node {} log ----\n{}", self.addr, self.log());
        }
    }
}

/// A request with these token ids, greedy, at most `max_tokens`.
pub fn greedy(prompt: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt_token_ids: prompt,
        sampling: Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// A finished Generate stream.
#[derive(Debug)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finished: pb::Finished,
}

/// Read a Generate stream to its end; `Err` if the call was refused or failed.
pub async fn complete(mut stream: tonic::Streaming<pb::GenerateResponse>) -> Result<Completion, Status> {
    use pb::generate_response::Kind;
    let (mut tokens, mut text) = (Vec::new(), String::new());
    while let Some(msg) = stream.message().await? {
        match msg.kind.expect("a response has a kind") {
            Kind::Delta(d) => {
                tokens.extend(d.token_ids);
                text += &d.text;
            }
            Kind::Finished(finished) => {
                assert!(stream.message().await?.is_none(), "nothing follows Finished");
                return Ok(Completion { tokens, text, finished });
            }
        }
    }
    panic!("the stream ended without a Finished message")
}

/// Send one request and read its whole stream.
pub async fn generate(client: &mut WorkerClient<Channel>, req: pb::GenerateRequest) -> Result<Completion, Status> {
    let stream = client.generate(req).await?.into_inner();
    complete(stream).await
}
