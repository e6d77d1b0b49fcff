// Command pause is the sandbox ("infra") container of the e2e suite's pods. The suite has no registry to pull
// registry.k8s.io/pause from, so it builds this static binary into a local image instead.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		// As PID 1 of the pod's namespaces we inherit orphans; reap them so they do not pile up as zombies.
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
