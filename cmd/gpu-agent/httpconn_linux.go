package main

import (
	"net"
	"syscall"
	"time"
)

// deferAccept has the kernel hand the listener a connection only once its
// client's first bytes have arrived (TCP_DEFER_ACCEPT), or after about
// wait if none come. A connection is then never closed as one that waits
// on its client merely because its client wrote a moment after we read,
// and clients that say nothing hold no descriptor of ours meanwhile.
func deferAccept(rc syscall.RawConn, wait time.Duration) error {
	secs := max(1, int((wait+time.Second-1)/time.Second))
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_DEFER_ACCEPT, secs)
	}); err != nil {
		return err
	}
	return serr
}

// peek copies into b what the kernel holds from c's peer, without taking
// it out, and says how much it copied.
func peek(c net.Conn, b []byte) int {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return 0
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return 0
	}
	var n int
	var rerr error
	if err := rc.Control(func(fd uintptr) {
		n, _, rerr = syscall.Recvfrom(int(fd), b, syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	}); err != nil || rerr != nil {
		return 0
	}
	return n
}

// hasUnread says whether the kernel holds bytes from c's peer that no one
// has read yet. It peeks, so they stay for the reader.
func hasUnread(c net.Conn) bool {
	var b [1]byte
	return peek(c, b[:]) > 0
}
