//! A client for tests. Prints one JSON object per attempt on stdout:
//! `{"ok":true,"reply":"pod1 hi","peer":"10.96.0.10:80","from":null,"errno":null,"ms":1}`.
//!
//! - `ferry-probe tcp ADDR [COUNT]`: connect, getpeername, send `hi`, read a line.
//! - `ferry-probe udp ADDR [COUNT]`: unconnected sendto + recvfrom (`from` = reply source).
//! - `ferry-probe udp-connected ADDR [COUNT]`: connect + send + recv + getpeername.
//! - `ferry-probe udp-multi ADDR [COUNT]`: one unconnected socket, COUNT sendto + recvfrom
//!   on it (one line each), so a test can see per-socket stickiness.
//! - `ferry-probe udp-session ADDR`: one unconnected socket; prints `ready`, then each
//!   stdin line is sent with sendto and the reply printed, so a test can change the
//!   Service between datagrams of one socket.
//! - `ferry-probe tcp-session ADDR`: one connection; each stdin line is sent and its
//!   reply printed (with what getpeername says then), so a test can prove an established
//!   connection keeps working and keeps reporting the Service address.
//! - `ferry-probe udp-connected-loop ADDR MILLIS`: a resolver-like client for MILLIS ms:
//!   one connected UDP socket, a query every 50 ms, one line per query (with `seq`, `op`,
//!   `local` and `t_ms` since start). On any error it closes the socket and connects a new
//!   one to ADDR (a `"op":"connect"` line), as a resolver does, then goes on querying.
//! - `ferry-probe udp-ports ADDR FIRST COUNT`: COUNT connected sockets, bound to the
//!   source ports FIRST, FIRST+1, ...: one datagram each, one line each (`from` = the
//!   local address), so a test can follow fixed 5-tuples across a change.
//!
//! `FERRY_PROBE_PAYLOAD` replaces the `hi` that `tcp`, `udp`, `udp-connected`,
//! `udp-ports` send (`whoami` makes ferry-testsrv answer with the address it sees).

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

#[derive(serde::Serialize, Default)]
struct Outcome {
    ok: bool,
    reply: Option<String>,
    peer: Option<String>,
    from: Option<String>,
    errno: Option<i32>,
    error: Option<String>,
    ms: u128,
}

const TIMEOUT: Duration = Duration::from_secs(2);

/// What `tcp`, `udp` and `udp-ports` send (a line for TCP).
fn payload() -> String {
    std::env::var("FERRY_PROBE_PAYLOAD").unwrap_or_else(|_| "hi".into())
}

fn fail(e: std::io::Error, started: Instant) -> Outcome {
    Outcome {
        errno: e.raw_os_error(),
        error: Some(e.to_string()),
        ms: started.elapsed().as_millis(),
        ..Default::default()
    }
}

fn tcp(addr: SocketAddr) -> Outcome {
    let t = Instant::now();
    let s = match TcpStream::connect_timeout(&addr, TIMEOUT) {
        Ok(s) => s,
        Err(e) => return fail(e, t),
    };
    let peer = s.peer_addr().ok().map(|p| p.to_string());
    s.set_read_timeout(Some(TIMEOUT)).ok();
    let mut w = s.try_clone().expect("clone");
    if let Err(e) = w.write_all(format!("{}\n", payload()).as_bytes()) {
        return fail(e, t);
    }
    let mut line = String::new();
    match BufReader::new(s).read_line(&mut line) {
        Ok(n) if n > 0 => Outcome {
            ok: true,
            reply: Some(line.trim().into()),
            peer,
            ms: t.elapsed().as_millis(),
            ..Default::default()
        },
        Ok(_) => Outcome {
            peer,
            error: Some("connection closed without reply".into()),
            ms: t.elapsed().as_millis(),
            ..Default::default()
        },
        Err(e) => Outcome { peer, ..fail(e, t) },
    }
}

fn bind_any(addr: &SocketAddr) -> std::io::Result<UdpSocket> {
    let s = if addr.is_ipv4() {
        UdpSocket::bind("0.0.0.0:0")?
    } else {
        UdpSocket::bind("[::]:0")?
    };
    s.set_read_timeout(Some(TIMEOUT))?;
    Ok(s)
}

fn udp(addr: SocketAddr, connected: bool) -> Outcome {
    let t = Instant::now();
    let run = || -> std::io::Result<Outcome> {
        let s = bind_any(&addr)?;
        let mut buf = [0u8; 2048];
        if connected {
            s.connect(addr)?;
            s.send(payload().as_bytes())?;
            let (n, from) = s.recv_from(&mut buf)?;
            let peer = s.peer_addr().ok().map(|p| p.to_string());
            return Ok(Outcome {
                ok: true,
                reply: Some(String::from_utf8_lossy(&buf[..n]).into()),
                peer,
                from: Some(from.to_string()),
                ..Default::default()
            });
        }
        s.send_to(payload().as_bytes(), addr)?;
        let (n, from) = s.recv_from(&mut buf)?;
        Ok(Outcome {
            ok: true,
            reply: Some(String::from_utf8_lossy(&buf[..n]).into()),
            from: Some(from.to_string()),
            ..Default::default()
        })
    };
    match run() {
        Ok(o) => Outcome {
            ms: t.elapsed().as_millis(),
            ..o
        },
        Err(e) => fail(e, t),
    }
}

/// COUNT datagrams on one unconnected socket; one outcome per datagram.
fn udp_multi(addr: SocketAddr, count: usize) {
    let t = Instant::now();
    let s = match bind_any(&addr) {
        Ok(s) => s,
        Err(e) => {
            println!("{}", serde_json::to_string(&fail(e, t)).unwrap());
            return;
        }
    };
    let mut buf = [0u8; 2048];
    for i in 0..count {
        let t = Instant::now();
        let out = match s
            .send_to(format!("hi{i}").as_bytes(), addr)
            .and_then(|_| s.recv_from(&mut buf))
        {
            Ok((n, from)) => Outcome {
                ok: true,
                reply: Some(String::from_utf8_lossy(&buf[..n]).into()),
                from: Some(from.to_string()),
                ms: t.elapsed().as_millis(),
                ..Default::default()
            },
            Err(e) => fail(e, t),
        };
        println!("{}", serde_json::to_string(&out).unwrap());
    }
}

/// One connected socket per source port in `first..first+count`, one datagram each.
fn udp_ports(addr: SocketAddr, first: u16, count: u16) {
    for port in first..first.saturating_add(count) {
        let t = Instant::now();
        let run = || -> std::io::Result<Outcome> {
            let local: SocketAddr = if addr.is_ipv4() {
                ([0, 0, 0, 0], port).into()
            } else {
                (std::net::Ipv6Addr::UNSPECIFIED, port).into()
            };
            let s = UdpSocket::bind(local)?;
            s.set_read_timeout(Some(TIMEOUT))?;
            s.connect(addr)?;
            s.send(payload().as_bytes())?;
            let mut buf = [0u8; 2048];
            let n = s.recv(&mut buf)?;
            Ok(Outcome {
                ok: true,
                reply: Some(String::from_utf8_lossy(&buf[..n]).into()),
                peer: s.peer_addr().ok().map(|p| p.to_string()),
                from: s.local_addr().ok().map(|p| p.to_string()),
                ms: t.elapsed().as_millis(),
                ..Default::default()
            })
        };
        let out = run().unwrap_or_else(|e| fail(e, t));
        println!("{}", serde_json::to_string(&out).unwrap());
    }
}

fn udp_session(addr: SocketAddr) {
    let s = bind_any(&addr).expect("bind");
    println!("ready");
    std::io::stdout().flush().ok();
    let mut buf = [0u8; 2048];
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let t = Instant::now();
        let out = match s
            .send_to(line.as_bytes(), addr)
            .and_then(|_| s.recv_from(&mut buf))
        {
            Ok((n, from)) => Outcome {
                ok: true,
                reply: Some(String::from_utf8_lossy(&buf[..n]).into()),
                from: Some(from.to_string()),
                ms: t.elapsed().as_millis(),
                ..Default::default()
            },
            Err(e) => fail(e, t),
        };
        println!("{}", serde_json::to_string(&out).unwrap());
        std::io::stdout().flush().ok();
    }
}

fn session(addr: SocketAddr) {
    let s = TcpStream::connect_timeout(&addr, TIMEOUT).expect("connect");
    s.set_read_timeout(Some(TIMEOUT)).ok();
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::new(s);
    println!("connected");
    std::io::stdout().flush().ok();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let t = Instant::now();
        let out = match writeln!(w, "{line}") {
            Err(e) => fail(e, t),
            Ok(()) => {
                let mut reply = String::new();
                match r.read_line(&mut reply) {
                    Ok(n) if n > 0 => Outcome {
                        ok: true,
                        reply: Some(reply.trim().into()),
                        // What getpeername says now (after an agent upgrade, say).
                        peer: r.get_ref().peer_addr().ok().map(|p| p.to_string()),
                        ms: t.elapsed().as_millis(),
                        ..Default::default()
                    },
                    Ok(_) => Outcome {
                        error: Some("closed".into()),
                        ..Default::default()
                    },
                    Err(e) => fail(e, t),
                }
            }
        };
        println!("{}", serde_json::to_string(&out).unwrap());
        std::io::stdout().flush().ok();
    }
}

/// One line of `udp-connected-loop`: an [`Outcome`] plus where it happened.
#[derive(serde::Serialize)]
struct LoopLine {
    /// `connect` (a new socket was connected) or `query`.
    op: &'static str,
    seq: u64,
    /// The socket's local address (distinguishes one socket from the next).
    local: Option<String>,
    /// Milliseconds since the probe started.
    t_ms: u128,
    #[serde(flatten)]
    out: Outcome,
}

fn udp_connected_loop(addr: SocketAddr, millis: u64) {
    const INTERVAL: Duration = Duration::from_millis(50);
    const QUERY_TIMEOUT: Duration = Duration::from_millis(300);
    let start = Instant::now();
    let emit = |op: &'static str, seq: u64, local: Option<String>, out: Outcome| {
        let line = LoopLine {
            op,
            seq,
            local,
            t_ms: start.elapsed().as_millis(),
            out,
        };
        println!("{}", serde_json::to_string(&line).unwrap());
        std::io::stdout().flush().ok();
    };
    let connect = || -> std::io::Result<UdpSocket> {
        let s = bind_any(&addr)?;
        s.set_read_timeout(Some(QUERY_TIMEOUT))?;
        s.connect(addr)?;
        Ok(s)
    };
    let mut sock: Option<(UdpSocket, Option<String>)> = None;
    let mut seq = 0u64;
    let mut next = Instant::now();
    let mut buf = [0u8; 2048];
    let mut retried = false;
    while start.elapsed() < Duration::from_millis(millis) {
        if sock.is_none() {
            let t = Instant::now();
            match connect() {
                Ok(s) => {
                    let local = s.local_addr().ok().map(|a| a.to_string());
                    let out = Outcome {
                        ok: true,
                        peer: s.peer_addr().ok().map(|p| p.to_string()),
                        ms: t.elapsed().as_millis(),
                        ..Default::default()
                    };
                    emit("connect", seq, local.clone(), out);
                    sock = Some((s, local));
                }
                Err(e) => emit("connect", seq, None, fail(e, t)),
            }
        }
        if let Some((s, local)) = &sock {
            seq += 1;
            let t = Instant::now();
            let q = format!("q{seq}");
            let want = format!(" {q}");
            let res = s.send(q.as_bytes()).and_then(|_| {
                loop {
                    let n = s.recv(&mut buf)?;
                    let reply = String::from_utf8_lossy(&buf[..n]).into_owned();
                    // A late answer to an earlier query: skip it.
                    if reply.ends_with(&want) {
                        break Ok(reply);
                    }
                }
            });
            let failed = res.is_err();
            let out = match res {
                Ok(reply) => Outcome {
                    ok: true,
                    reply: Some(reply),
                    peer: s.peer_addr().ok().map(|p| p.to_string()),
                    ms: t.elapsed().as_millis(),
                    ..Default::default()
                },
                Err(e) => fail(e, t),
            };
            emit("query", seq, local.clone(), out);
            if failed {
                // What a resolver does: drop the socket, open a new one to the server
                // and ask again at once (once: a server that keeps failing waits a tick).
                sock = None;
                if !retried {
                    retried = true;
                    continue;
                }
            } else {
                retried = false;
            }
        }
        next += INTERVAL;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("");
    let addr: SocketAddr = args
        .get(1)
        .and_then(|a| a.parse().ok())
        .expect("usage: ferry-probe MODE ADDR:PORT [COUNT]");
    let count: usize = args.get(2).and_then(|c| c.parse().ok()).unwrap_or(1);
    if mode == "tcp-session" {
        return session(addr);
    }
    if mode == "udp-multi" {
        return udp_multi(addr, count);
    }
    if mode == "udp-ports" {
        let first: u16 = args.get(2).and_then(|c| c.parse().ok()).unwrap_or(40000);
        let count: u16 = args.get(3).and_then(|c| c.parse().ok()).unwrap_or(1);
        return udp_ports(addr, first, count);
    }
    if mode == "udp-session" {
        return udp_session(addr);
    }
    if mode == "udp-connected-loop" {
        let millis: u64 = args.get(2).and_then(|c| c.parse().ok()).unwrap_or(10_000);
        return udp_connected_loop(addr, millis);
    }
    for _ in 0..count {
        let out = match mode {
            "tcp" => tcp(addr),
            "udp" => udp(addr, false),
            "udp-connected" => udp(addr, true),
            _ => panic!("unknown mode {mode}"),
        };
        println!("{}", serde_json::to_string(&out).unwrap());
    }
}
