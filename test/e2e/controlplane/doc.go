// Package controlplane holds e2e tests of real components on a real control plane without a kubelet: fake
// Ready Nodes, gpu-agent processes publishing for them, and the test calling the agents' kubelet-plugin
// sockets where a kubelet would. Run them with ../run.sh (build tag e2e); see ../README.md.
package controlplane
