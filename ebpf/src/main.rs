//! ferry's eBPF programs: entry points only. Lookup and selection live in `lb`, the
//! socket hooks in `sock`, the tc datapath for external traffic in `tc`, maps in `maps`.
// Entry points must stay `pub` so the loader finds them by name.
#![allow(unreachable_pub)]
#![no_std]
#![no_main]

mod lb;
mod maps;
mod sock;
mod tc;

use aya_ebpf::{
    macros::{cgroup_sock_addr, classifier},
    programs::{SockAddrContext, TcContext},
};
use sock::{Family, reverse, translate};

#[cgroup_sock_addr(connect4)]
pub fn ferry_connect4(ctx: SockAddrContext) -> i32 {
    translate(&ctx, Family::V4, false)
}

#[cgroup_sock_addr(connect6)]
pub fn ferry_connect6(ctx: SockAddrContext) -> i32 {
    translate(&ctx, Family::V6, false)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn ferry_sendmsg4(ctx: SockAddrContext) -> i32 {
    translate(&ctx, Family::V4, true)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn ferry_sendmsg6(ctx: SockAddrContext) -> i32 {
    translate(&ctx, Family::V6, true)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn ferry_recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, Family::V4, false)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn ferry_recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, Family::V6, false)
}

#[cgroup_sock_addr(getpeername4)]
pub fn ferry_getpeername4(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, Family::V4, true)
}

#[cgroup_sock_addr(getpeername6)]
pub fn ferry_getpeername6(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, Family::V6, true)
}

/// tcx ingress on node devices: NodePort / externalIP / LoadBalancer traffic from
/// outside the node, and replies to source-NATed flows.
#[classifier]
pub fn ferry_tc_ingress(ctx: TcContext) -> i32 {
    tc::ingress(&ctx)
}

/// tcx egress on node devices: local endpoints' replies get their frontend back.
#[classifier]
pub fn ferry_tc_egress(ctx: TcContext) -> i32 {
    tc::egress(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// The license the kernel checks before it allows GPL-only helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
