package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-agent/gpu-agent/kube"
)

// cmdNodeCleanup removes the labels gpu-agent owns (and its ownership
// annotation) from one Node or from every Node carrying them: what an
// uninstall runs, since the agent cannot tell an upgrade's SIGTERM from an
// uninstall's and must keep the labels through an upgrade.
func cmdNodeCleanup(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("node-cleanup", "node-cleanup [--all | --node-name N] [--kubeconfig FILE]", stderr)
	host, _ := os.Hostname()
	node := fs.String("node-name", envDefault("NODE_NAME", host), "the Node to clean [NODE_NAME]")
	all := fs.Bool("all", false, "every Node that carries gpu-agent's labels")
	kubeconfig := fs.String("kubeconfig", envDefault("KUBECONFIG", ""), "kubeconfig (empty: in-cluster config) [KUBECONFIG]")
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	clients, _, err := kube.Connect(*kubeconfig, "gpu-agent-node-cleanup")
	if err != nil {
		return err
	}
	if clients == nil {
		return errors.New("no Kubernetes API: give --kubeconfig, or run it in a pod")
	}
	client := clients.Agent
	nodes := []string{*node}
	if *all {
		list, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return fmt.Errorf("list nodes: %w", err)
		}
		nodes = nodes[:0]
		for _, n := range list.Items {
			if _, ok := n.Annotations[kube.OwnedLabelsAnnotation]; ok {
				nodes = append(nodes, n.Name)
			}
		}
	}
	var errs []error
	for _, n := range nodes {
		removed, err := kube.RemoveOwned(ctx, client, n)
		if err != nil {
			errs = append(errs, fmt.Errorf("node %s: %w", n, err))
			continue
		}
		fmt.Fprintf(stdout, "node %s: removed %d labels\n", n, removed)
	}
	return errors.Join(errs...)
}
