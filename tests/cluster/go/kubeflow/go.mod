// The Kubeflow training-operator, built from its module (tests/cluster/build.sh).
module packtrain.dev/tests/cluster/kubeflow

go 1.24

require github.com/kubeflow/training-operator v1.9.3

tool github.com/kubeflow/training-operator/cmd/training-operator.v1
