__all__ = ['ttypes', 'constants', 'UserService']
